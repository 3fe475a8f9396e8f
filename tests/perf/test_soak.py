"""The soak script (perf/soak.py) at tiny numbers, so it cannot rot; and how it sorts errors."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from inference.loadgen.summary import RequestRecord
from perf.soak import Result, Sample, parse_args, summarize

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # a 6 s soak of real processes: out of make test-fast
def test_a_tiny_soak_runs_clean_prints_its_tables_and_cleans_up(tmp_path):
    out = tmp_path / "soak.json"
    run = subprocess.run(
        [sys.executable, "-m", "perf.soak", "--clients", "8", "--direct-clients", "2",
         "--quota-clients", "1", "--duration", "5", "--warmup", "1", "--mix", "fixed:64:16",
         "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=90,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    for row in (r"\| gateway, all +\|", r"\| direct +\|", r"\| added, same requests +\|", r"\| growth +\|",
                r"\| ≤ 2000 \(short\)", r"\| not intended, total +\| +0 \|"):  # fmt: skip
        assert re.search(row, run.stdout), row
    summary = json.loads(out.read_text())
    assert summary["errors"]["not_intended_total"] == 0
    # The low-quota key (2 rpm) was refused, and those 429s were counted apart.
    assert summary["errors"]["quota_intended"].get("quota: HTTP 429 rate_limit_exceeded", 0) >= 1
    assert summary["paths"]["gateway"]["requests"] >= 8 and summary["paths"]["direct"]["requests"] >= 2
    assert summary["paths"]["gateway"]["ttft_p99_ms"] > 0
    requests = summary["requests"]
    assert summary["usage_rows"] == requests["gateway"] + requests["quota"]
    assert summary["engine"]["gateway_streams_min"] >= 1
    assert summary["memory"]["start_mb"] > 10 and summary["memory"]["samples"] >= 3
    # Its throwaway directory (database, logs) is gone, and its processes with it.
    directory = re.search(r"setting up in (\S+)", run.stdout).group(1)
    assert not Path(directory).exists()
    assert directory not in subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout


def test_only_the_low_quota_keys_429s_are_intended_and_a_missing_usage_record_is_an_error():
    args = parse_args(["--clients", "2", "--duration", "10", "--warmup", "2"])
    args.long_prompt_tokens = 2000

    def streamed(ttft: float, total: float) -> RequestRecord:
        # 10 tokens, the first at `ttft`, the last at `total`, as the streaming client records them.
        times = [ttft + (total - ttft) * i / 9 for i in range(10)]
        return RequestRecord(0.0, times, 64, 10, status=200)

    refused = "HTTP 429 rate_limit_exceeded: slow down"
    results = [
        Result("gateway", 3.0, streamed(0.05, 1.0)),
        Result("direct", 3.0, streamed(0.04, 1.0)),
        Result("gateway", 3.5, streamed(0.3, 1.2), long_prompt=True),
        Result("direct", 3.5, streamed(0.1, 1.1), long_prompt=True),
        Result("quota", 3.0, RequestRecord(0.0, status=429, error=refused)),
        Result("gateway", 4.0, RequestRecord(0.0, status=429, error=refused)),
        Result("gateway", 5.0, RequestRecord(0.0, [0.1, 0.2, 0.3], 64, 3, status=200,
                                             error="stream ended without [DONE]")),
    ]  # fmt: skip
    samples = [
        Sample(t, 100.0 + t, t / 10, t / 20, {"gateway": 2}, 4, 0, 0) for t in (2.0, 5.0, 7.0, 9.0, 11.0)
    ]
    load = {"results": results, "samples": samples, "warm_s": 2.0, "stop_s": 12.0, "drained_s": 12.5,
            "idle_rss_mb": 90.0, "after_drain_rss_mb": 112.0, "client": {}}  # fmt: skip
    summary = summarize(load, args, usage_rows=4)
    errors = summary["errors"]
    assert errors["quota_intended"] == {"quota: HTTP 429 rate_limit_exceeded": 1}
    assert errors["not_intended"] == {
        "gateway: HTTP 429 rate_limit_exceeded": 1,
        "gateway: stream ended without [DONE]": 1,
        "usage records missing (gateway requests without a row)": 1,
    }
    assert errors["not_intended_total"] == 3
    assert summary["paths"]["gateway"]["requests"] == 2
    by_prompt = summary["ttft_by_prompt"]
    assert by_prompt["short"]["added_p50_ms"] == pytest.approx(10.0)
    assert by_prompt["long"]["added_p50_ms"] == pytest.approx(200.0)
    assert by_prompt["long"]["gateway"]["requests"] == 1
    memory = summary["memory"]
    assert (memory["start_mb"], memory["end_mb"], memory["growth_mb"]) == (102.0, 111.0, 9.0)
    assert memory["slope_last_half_mb_min"] == pytest.approx(60.0)  # 1 MB/s over the second half
