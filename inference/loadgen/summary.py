"""Per-level statistics, defined exactly as vLLM's `vllm bench serve` defines them.

vLLM (benchmarks/serve.py, lib/endpoint_request_func.py) times a streamed
request like this, and so does our one streaming client (`inference.loadgen.client`),
which fills a `RequestRecord` for the load generator, the soak and the proxy benchmark:
- the clock starts just before the HTTP request;
- every streamed chunk with a non-empty `choices` list is a token event (the
  usage-only chunk and `[DONE]` are not), however many tokens it carries;
- TTFT = first event − start; E2EL = last event − start;
- TPOT = (E2EL − TTFT) / (output tokens − 1), requests with ≤ 1 output token left
  out of TPOT; ITL = every gap between consecutive events, pooled over requests;
- output tokens come from the server's `usage`;
- throughput = tokens ÷ duration; goodput = requests meeting every SLO ÷ duration;
- statistics: numpy's, as vLLM's: mean, median, std (population, numpy's
  default) and `np.percentile` with its default "linear" method (interpolation
  between closest ranks), named explicitly so a numpy default change cannot move them.

Two deliberate differences, both about not hiding a problem: a statistic over an
empty sample is None (vLLM prints 0), and `duration` is first request start →
last completion (vLLM times its whole gather, which is the same up to the
scheduling of the first task).

Each level also checks itself against Little's law over its steady window (see
`little_law`).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np

LITTLE_LAW_TOLERANCE = 0.10
METRICS = ("ttft", "tpot", "itl", "e2el")
PERCENTILES = (90, 95, 99)
# vLLM's `benchmarks/serve.py` calls np.percentile with numpy's default, "linear".
PERCENTILE_METHOD: Final = "linear"


@dataclass
class RequestRecord:
    """One request as the client saw it; times in seconds on any one clock."""

    start: float
    token_times: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str | None = None
    # When a failed request gave up (None: unknown); successful ones end at their last event.
    end: float | None = None
    status: int = 0  # the HTTP status (0: no response)

    @property
    def error_kind(self) -> str:
        """The error without its detail ("HTTP 429 rate_limit_exceeded"; "" when none), for counting."""
        return (self.error or "").partition(": ")[0]

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.token_times)

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.start

    @property
    def e2el(self) -> float:
        return self.token_times[-1] - self.start

    @property
    def tpot(self) -> float | None:
        if self.output_tokens <= 1:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        times = self.token_times
        return [b - a for a, b in itertools.pairwise(times)]

    @property
    def finished(self) -> float | None:
        if self.token_times and self.error is None:
            return self.token_times[-1]
        return self.end


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile by linear interpolation between closest ranks (numpy's "linear").

    An empty sample has none: callers report None (see `describe`), never 0.
    """
    if len(values) == 0:
        raise ValueError("percentile of an empty sample")
    return float(np.percentile(values, q, method=PERCENTILE_METHOD))


def describe(values: list[float], name: str) -> dict[str, float | None]:
    """mean/median/std/pXX of `values` (seconds) in ms, under vLLM's key names; None when empty."""
    keys = [f"mean_{name}_ms", f"median_{name}_ms", f"std_{name}_ms"] + [
        f"p{p}_{name}_ms" for p in PERCENTILES
    ]
    if not values:
        return dict.fromkeys(keys)
    sample = np.asarray(values, dtype=float)
    out: dict[str, float | None] = {
        f"mean_{name}_ms": float(sample.mean()) * 1000,
        f"median_{name}_ms": float(np.median(sample)) * 1000,
        f"std_{name}_ms": float(sample.std()) * 1000,
    }
    ranks = np.percentile(sample, PERCENTILES, method=PERCENTILE_METHOD)
    for p, value in zip(PERCENTILES, ranks, strict=True):
        out[f"p{p}_{name}_ms"] = float(value) * 1000
    return out


def _tokens_in_window(records: list[RequestRecord], low: float, high: float) -> float:
    """Output tokens emitted in [low, high]; a multi-token chunk counts for its share of the usage total."""
    total = 0.0
    for record in records:
        per_event = record.output_tokens / len(record.token_times)
        total += per_event * sum(1 for t in record.token_times if low <= t <= high)
    return total


def _mean_in_flight(records: list[RequestRecord], low: float, high: float) -> float:
    busy = 0.0
    for record in records:
        end = record.finished if record.finished is not None else high
        busy += max(0.0, min(end, high) - max(record.start, low))
    return busy / (high - low)


def little_law(
    records: list[RequestRecord], concurrency: int | None, *, warmup: Sequence[RequestRecord] = ()
) -> dict[str, Any]:
    """Does output throughput ≈ concurrency × mean output tokens ÷ mean E2EL hold?

    The steady window runs from the first request's start to the last request's
    start: in a closed loop every user is busy throughout it, and the drain after
    the last start (users finishing one by one) does not count. Warm-up requests
    are not measured, but those still streaming when the window opens keep their
    users busy, so their tokens inside the window count toward the throughput
    (else a short level reads ~concurrency ÷ requests low). An open-loop level has
    no fixed concurrency, so the window's time-averaged number in flight stands in.
    A miss by more than 10 % marks the level as a suspected measurement problem.
    """
    ok = [r for r in records if r.ok]
    result: dict[str, Any] = {
        "window_s": None,
        "concurrency_used": None,
        "measured_output_throughput": None,
        "expected_output_throughput": None,
        "ratio": None,
        "ok": None,
        "note": "",
    }
    if len(ok) < 2:
        result["note"] = "too few completed requests for a steady window"
        return result
    low = min(r.start for r in ok)
    high = max(r.start for r in ok)
    if high - low <= 0 or (concurrency and len(ok) < 2 * concurrency):
        result["note"] = "steady window too short (fewer than two requests per user); not checked"
        return result
    occupancy = float(concurrency) if concurrency else _mean_in_flight(records, low, high)
    mean_out = float(np.mean([r.output_tokens for r in ok]))
    mean_e2el = float(np.mean([r.e2el for r in ok]))
    streaming = ok + [r for r in warmup if r.ok]
    measured = _tokens_in_window(streaming, low, high) / (high - low)
    expected = occupancy * mean_out / mean_e2el if mean_e2el > 0 else None
    result.update(window_s=high - low, concurrency_used=occupancy, measured_output_throughput=measured)
    if expected:
        ratio = measured / expected
        result.update(
            expected_output_throughput=expected, ratio=ratio, ok=abs(ratio - 1) <= LITTLE_LAW_TOLERANCE
        )
        if not result["ok"]:
            result["note"] = (
                f"measured {measured:.1f} tok/s vs {expected:.1f} expected by Little's law "
                f"({(ratio - 1) * 100:+.0f} %): suspected measurement problem"
            )
    return result


def summarize_level(
    records: list[RequestRecord],
    *,
    concurrency: int | None,
    slo: dict[str, float] | None = None,
    warmup: Sequence[RequestRecord] = (),
) -> dict[str, Any]:
    """One level's results under vLLM's key names.

    `slo` is vLLM's goodput config: {"ttft" | "tpot" | "e2el": limit in ms}. `warmup`
    holds the level's unmeasured warm-up requests, used only by the Little's-law check.
    """
    completed = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    errors: dict[str, int] = {}
    for record in failed:
        reason = record.error or "no token received"
        errors[reason] = errors.get(reason, 0) + 1

    starts = [r.start for r in records]
    ends = [r.finished for r in records if r.finished is not None]
    duration = (max(ends) - min(starts)) if starts and ends else None
    if duration is not None and duration <= 0:
        duration = None

    total_in = sum(r.prompt_tokens for r in completed)
    total_out = sum(r.output_tokens for r in completed)
    ttfts = [r.ttft for r in completed]
    e2els = [r.e2el for r in completed]
    tpots = [t for r in completed if (t := r.tpot) is not None]
    itls = [gap for r in completed for gap in r.itls]

    def rate(amount: float) -> float | None:
        return amount / duration if duration else None

    goodput = None
    if slo:
        good = 0
        for r in completed:
            # vLLM counts a ≤1-token request's TPOT as 0 for goodput.
            seconds = {"ttft": r.ttft, "tpot": r.tpot or 0.0, "e2el": r.e2el}
            if all(seconds[k] <= limit / 1000 for k, limit in slo.items()):
                good += 1
        goodput = rate(good)

    level: dict[str, Any] = {
        "concurrency": concurrency,
        "completed": len(completed),
        "failed": len(failed),
        "duration": duration,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": rate(len(completed)),
        "output_throughput": rate(total_out),
        "total_token_throughput": rate(total_in + total_out),
        "request_goodput": goodput,
    }
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        level.update(describe(values, name))
    level["little_law"] = little_law(records, concurrency, warmup=warmup)
    level["errors"] = errors
    return level


def _num(value: float | None, fmt: str = "{:.1f}") -> str:
    return "—" if value is None else fmt.format(value)


TABLE_COLUMNS = (
    "concurrency",
    "ok/failed",
    "out tok/s",
    "req/s",
    "mean TTFT ms",
    "P95 TTFT ms",
    "mean TPOT ms",
    "P95 TPOT ms",
    "mean E2EL ms",
)


def format_table(levels: list[dict[str, Any]]) -> str:
    """The per-level table the bench command prints (a preemptions column when levels carry it)."""
    with_preemptions = any(level.get("preemptions") is not None for level in levels)
    header = list(TABLE_COLUMNS) + (["preemptions"] if with_preemptions else []) + ["notes"]
    rows = []
    for level in levels:
        notes = []
        little = level.get("little_law") or {}
        if little.get("ok") is False:
            notes.append(f"Little's law off {(little['ratio'] - 1) * 100:+.0f} %")
        if level.get("client_bound"):
            notes.append("client-bound")
        elif level.get("host_note"):
            notes.append("busy host")
        if level.get("partial"):
            notes.append(f"partial: {level.get('partial_reason') or 'stopped early'}")
        concurrency = level.get("concurrency")
        if concurrency is None and level.get("request_rate") is not None:
            concurrency_text = f"rate {level['request_rate']:g}/s"
        else:
            concurrency_text = _num(concurrency, "{}")
        row = [
            concurrency_text,
            f"{level.get('completed', 0)}/{level.get('failed', 0)}",
            _num(level.get("output_throughput")),
            _num(level.get("request_throughput"), "{:.2f}"),
            _num(level.get("mean_ttft_ms")),
            _num(level.get("p95_ttft_ms")),
            _num(level.get("mean_tpot_ms")),
            _num(level.get("p95_tpot_ms")),
            _num(level.get("mean_e2el_ms")),
        ]
        if with_preemptions:
            row.append(_num(level.get("preemptions"), "{:.0f}"))
        row.append("; ".join(notes))
        rows.append(row)
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows, strict=True)]
    lines = [
        " | ".join(str(cell).rjust(width) for cell, width in zip(line, widths, strict=True))
        for line in [header, *rows]
    ]
    lines.insert(1, "-+-".join("-" * width for width in widths))
    return "\n".join(line.rstrip() for line in lines)


def little_law_from_table(level: dict[str, Any]) -> dict[str, Any]:
    """Little's law on a level known only from a table (an import): concurrency, throughput, latencies.

    With mean E2EL and mean output tokens: expected = C × tokens ÷ E2EL. Without them
    (the 7B table of docs/v100-field-guide.md#reference-run has neither), mean TPOT
    still bounds it: each of C streams
    emits at most one token per TPOT after its first, so output throughput ≤ C ÷ TPOT
    (times out/(out−1) ≈ 1 for outputs of hundreds of tokens). A table reporting more is
    inconsistent: TPOT or throughput was measured some other way.
    """
    result = {
        "measured_output_throughput": level.get("output_throughput"),
        "expected_output_throughput": None,
        "ratio": None,
        "ok": None,
        "bound": False,
        "note": "",
    }
    concurrency = level.get("concurrency")
    measured = level.get("output_throughput")
    if not concurrency or measured is None:
        result["note"] = "needs concurrency and output throughput"
        return result
    e2el_ms, tokens, tpot_ms = (
        level.get("mean_e2el_ms"),
        level.get("mean_output_tokens"),
        level.get("mean_tpot_ms"),
    )
    if e2el_ms and tokens:
        expected = concurrency * tokens / (e2el_ms / 1000)
        ratio = measured / expected
        result.update(
            expected_output_throughput=expected, ratio=ratio, ok=abs(ratio - 1) <= LITTLE_LAW_TOLERANCE
        )
        if not result["ok"]:
            result["note"] = (
                f"{concurrency} × {tokens:.0f} tokens ÷ {e2el_ms / 1000:.2f} s = "
                f"{expected:.0f} tok/s expected, {measured:.0f} reported ({ratio:.2f}×)"
            )
        return result
    if tpot_ms:
        bound = concurrency / (tpot_ms / 1000)
        ratio = measured / bound
        result.update(
            expected_output_throughput=bound, ratio=ratio, bound=True, ok=ratio <= 1 + LITTLE_LAW_TOLERANCE
        )
        if not result["ok"]:
            result["note"] = (
                f"{concurrency} streams × 1 token per {tpot_ms / 1000:.3f} s can emit at most "
                f"~{bound:.0f} tok/s, yet {measured:.0f} tok/s is reported ({ratio:.1f}×): "
                "TPOT or throughput was measured some other way"
            )
        return result
    result["note"] = "needs mean E2EL and mean output tokens, or mean TPOT"
    return result
