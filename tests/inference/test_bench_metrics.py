"""Metric formulas on hand-built timelines, checked against vLLM's definitions."""

import math

import numpy as np
import pytest

from inference.loadgen.summary import (
    RequestRecord,
    describe,
    format_table,
    little_law,
    percentile,
    summarize_level,
)


def test_it_times_one_request_like_vllm():
    # Start at 10.0; first chunk at 10.5; then 3 more one-token chunks 0.1 s apart.
    record = RequestRecord(
        start=10.0, token_times=[10.5, 10.6, 10.7, 10.8], prompt_tokens=100, output_tokens=4
    )
    level = summarize_level([record], concurrency=1)
    assert level["mean_ttft_ms"] == pytest.approx(500)
    assert level["mean_e2el_ms"] == pytest.approx(800)
    assert level["mean_tpot_ms"] == pytest.approx(100)  # (0.8 - 0.5) / (4 - 1)
    assert level["mean_itl_ms"] == pytest.approx(100)
    assert level["duration"] == pytest.approx(0.8)
    assert level["output_throughput"] == pytest.approx(4 / 0.8)
    assert level["total_token_throughput"] == pytest.approx(104 / 0.8)
    assert level["request_throughput"] == pytest.approx(1 / 0.8)


def test_it_takes_output_tokens_from_usage_when_chunks_carry_several_tokens():
    # 3 chunks carrying 10 tokens in all (e.g. 4 + 3 + 3): TPOT divides by the 9 gaps between
    # tokens, while ITL sees the 2 gaps between chunks.
    record = RequestRecord(start=0.0, token_times=[0.2, 0.5, 0.8], prompt_tokens=5, output_tokens=10)
    level = summarize_level([record], concurrency=1)
    assert level["mean_tpot_ms"] == pytest.approx((0.8 - 0.2) / 9 * 1000)
    assert level["mean_itl_ms"] == pytest.approx(300)
    assert level["total_output_tokens"] == 10
    assert level["output_throughput"] == pytest.approx(10 / 0.8)


def test_it_leaves_one_token_outputs_out_of_tpot_but_not_out_of_ttft():
    one = RequestRecord(start=0.0, token_times=[0.3], prompt_tokens=5, output_tokens=1)
    many = RequestRecord(start=0.0, token_times=[0.1, 0.3, 0.5], prompt_tokens=5, output_tokens=3)
    level = summarize_level([one, many], concurrency=2)
    assert level["mean_tpot_ms"] == pytest.approx(200)
    assert level["mean_ttft_ms"] == pytest.approx(200)
    assert level["mean_e2el_ms"] == pytest.approx(400)
    assert level["completed"] == 2


def test_it_reports_no_tpot_rather_than_zero_when_every_output_is_one_token():
    level = summarize_level([RequestRecord(0.0, [0.3], 5, 1)], concurrency=1)
    assert level["mean_tpot_ms"] is None
    assert level["p95_tpot_ms"] is None


def test_it_counts_failures_with_reasons_and_leaves_them_out_of_latency():
    good = RequestRecord(0.0, [0.1, 0.2], 5, 2)
    bad = RequestRecord(0.0, [], 5, 0, error="HTTP 500: boom", end=5.0)
    also_bad = RequestRecord(1.0, [], 5, 0, error="HTTP 500: boom", end=1.5)
    level = summarize_level([good, bad, also_bad], concurrency=3)
    assert level["completed"] == 1
    assert level["failed"] == 2
    assert level["errors"] == {"HTTP 500: boom": 2}
    assert level["mean_ttft_ms"] == pytest.approx(100)
    # Duration runs to the last completion, the failed request's give-up included.
    assert level["duration"] == pytest.approx(5.0)


def test_it_reports_nothing_when_everything_failed():
    level = summarize_level([RequestRecord(0.0, [], 5, 0, error="connection refused")], concurrency=1)
    assert level["completed"] == 0
    assert level["output_throughput"] is None
    assert level["mean_ttft_ms"] is None


def test_it_matches_numpy_statistics():
    rng = np.random.default_rng(3)
    records = []
    for i in range(37):
        start = float(i)
        gaps = rng.uniform(0.01, 0.2, size=int(rng.integers(2, 9)))
        times = list(start + 0.05 + np.cumsum(gaps))
        records.append(RequestRecord(start, times, 10, len(times)))
    level = summarize_level(records, concurrency=4)
    ttfts = np.array([r.token_times[0] - r.start for r in records])
    itls = np.concatenate([np.diff(r.token_times) for r in records])
    assert level["mean_ttft_ms"] == pytest.approx(ttfts.mean() * 1000)
    assert level["std_ttft_ms"] == pytest.approx(ttfts.std() * 1000)
    assert level["median_ttft_ms"] == pytest.approx(np.median(ttfts) * 1000)
    for p in (90, 95, 99):
        assert level[f"p{p}_ttft_ms"] == pytest.approx(np.percentile(ttfts, p) * 1000)
        assert level[f"p{p}_itl_ms"] == pytest.approx(np.percentile(itls, p) * 1000)


def test_it_interpolates_percentiles_like_numpy():
    values = [5.0, 1.0, 3.0, 10.0]
    for q in (0, 25, 50, 90, 95, 99, 100):
        assert percentile(values, q) == pytest.approx(np.percentile(values, q))


def _closest_ranks(values: list[float], q: float) -> float:
    """The definition summary.py used before it called numpy: the reference the switch must keep."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def test_numpys_linear_method_gives_the_former_closest_ranks_numbers():
    rng = np.random.default_rng(7)
    for n in (1, 2, 3, 10, 101, 1000):
        values = [float(v) for v in rng.exponential(0.2, size=n)]
        for q in (0, 1, 50, 90, 95, 99, 99.9, 100):
            assert percentile(values, q) == pytest.approx(_closest_ranks(values, q), rel=1e-12, abs=0)


def test_it_uses_the_linear_method_that_vllm_uses_and_no_other():
    values = [1.0, 2.0, 3.0, 4.0]
    assert percentile(values, 90) == pytest.approx(3.7)  # 2.7 ranks in: 3 + 0.7 × (4 − 3)
    others = ("lower", "higher", "nearest", "midpoint", "hazen", "weibull", "median_unbiased")
    for method in others:
        assert np.percentile(values, 90, method=method) != pytest.approx(3.7), method


def test_an_empty_sample_has_no_statistics():
    assert set(describe([], "ttft").values()) == {None}
    with pytest.raises(ValueError, match="empty"):
        percentile([], 50)


def test_it_counts_goodput_against_every_slo_in_ms():
    fast = RequestRecord(0.0, [0.1, 0.2, 0.3], 5, 3)  # TTFT 100 ms, TPOT 100 ms
    slow = RequestRecord(0.0, [0.5, 0.6, 0.7], 5, 3)  # TTFT 500 ms
    level = summarize_level([fast, slow], concurrency=2, slo={"ttft": 200, "tpot": 150})
    assert level["request_goodput"] == pytest.approx(1 / 0.7)
    assert summarize_level([fast], concurrency=1)["request_goodput"] is None


def closed_loop(
    concurrency: int, per_user: int, *, ttft: float, interval: float, tokens: int
) -> list[RequestRecord]:
    records = []
    for _ in range(concurrency):
        t = 0.0
        for _ in range(per_user):
            times = [t + ttft + k * interval for k in range(tokens)]
            records.append(RequestRecord(t, times, 10, tokens))
            t = times[-1]
    return records


def test_it_passes_littles_law_on_an_honest_closed_loop():
    records = closed_loop(4, 20, ttft=0.05, interval=0.01, tokens=64)
    check = little_law(records, 4)
    # 4 users × 64 tokens ÷ (0.05 + 63 × 0.01) s
    assert check["expected_output_throughput"] == pytest.approx(4 * 64 / 0.68)
    assert check["ok"] is True
    assert check["ratio"] == pytest.approx(1.0, abs=0.05)


def test_it_flags_a_level_whose_concurrency_was_not_what_it_claimed():
    # Only 2 users really ran, but the level claims 4: throughput is half what Little's law expects.
    records = closed_loop(2, 20, ttft=0.05, interval=0.01, tokens=64)
    level = summarize_level(records, concurrency=4)
    assert level["little_law"]["ok"] is False
    assert level["little_law"]["ratio"] == pytest.approx(0.5, abs=0.05)
    assert "suspected measurement problem" in level["little_law"]["note"]


def test_it_does_not_judge_a_window_that_is_too_short():
    records = closed_loop(4, 1, ttft=0.05, interval=0.01, tokens=8)
    assert little_law(records, 4)["ok"] is None


def test_it_prints_a_table_with_marks():
    level = summarize_level(closed_loop(2, 5, ttft=0.05, interval=0.01, tokens=8), concurrency=2)
    level["preemptions"] = 3
    level["client_bound"] = True
    table = format_table([level])
    lines = table.splitlines()
    assert "concurrency" in lines[0] and "preemptions" in lines[0]
    assert "client-bound" in lines[2]
    assert lines[2].split("|")[1].strip() == "10/0"


def staggered_closed_loop(
    users: int, per_user: int, *, e2el: float = 1.0, tokens: int = 10
) -> list[RequestRecord]:
    """Back-to-back requests per user, users staggered by e2el/users: warm-ups overlap the window."""
    records = []
    for user in range(users):
        start = user * e2el / users
        for _ in range(per_user):
            times = [start + e2el * (k + 1) / tokens for k in range(tokens)]
            records.append(RequestRecord(start, times, 5, tokens))
            start += e2el
    return sorted(records, key=lambda r: r.start)


def test_it_counts_warm_up_tokens_inside_the_steady_window():
    users = 8
    records = staggered_closed_loop(users, per_user=3)
    warmup, measured = records[:users], records[users:]
    check = summarize_level(measured, concurrency=users, warmup=warmup)["little_law"]
    assert check["ok"] is True
    assert check["ratio"] == pytest.approx(1.0, abs=0.05)


def test_it_reads_low_without_the_warm_up_tokens():
    users = 8
    records = staggered_closed_loop(users, per_user=3)
    check = summarize_level(records[users:], concurrency=users)["little_law"]
    assert check["ratio"] < 0.95
