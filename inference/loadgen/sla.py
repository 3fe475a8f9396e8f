"""The SLA operating point: the highest concurrency level whose P95 latencies meet the SLA.

Levels are walked from the lowest concurrency up; the operating point is the
last level before the first miss (a level over the SLA, with failed requests,
cut short, or whose load generator was the bottleneck). A higher level that
happens to pass after a miss is not chosen: it is noise on the way up, and a
gateway cap there would sit past a level already seen to fail.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Sla:
    """The field guide's SLA by default: P95 TTFT ≤ 3 s and P95 TPOT ≤ 0.2 s
    (docs/v100-field-guide.md#measuring)."""

    p95_ttft_s: float = 3.0
    p95_tpot_s: float = 0.2

    def describe(self) -> str:
        return f"P95 TTFT ≤ {self.p95_ttft_s:g} s, P95 TPOT ≤ {self.p95_tpot_s:g} s"


def level_misses(level: dict[str, Any], sla: Sla) -> list[str]:
    """Why a level misses the SLA (empty: it meets it)."""
    reasons = []
    if level.get("outside"):
        # A predicted level the simulator's twin cannot stand behind (inference.sim.confidence).
        reasons.append(f"no prediction: {level['outside']}")
    if level.get("failed"):
        reasons.append(f"{level['failed']} failed request(s)")
    if level.get("partial"):
        reasons.append("the level did not finish")
    if level.get("client_bound"):
        # Its latencies are the load generator's, not the server's: they cannot show the SLA is met.
        reasons.append(f"client-bound ({level.get('client_bound_reason') or 'load generator saturated'})")
    for metric, limit in (("ttft", sla.p95_ttft_s), ("tpot", sla.p95_tpot_s)):
        value_ms = level.get(f"p95_{metric}_ms")
        if value_ms is None:
            reasons.append(f"no P95 {metric.upper()} measured")
        elif value_ms / 1000 > limit:
            reasons.append(f"P95 {metric.upper()} {value_ms / 1000:.2f} s > {limit:g} s")
    return reasons


def operating_point(
    levels: list[dict[str, Any]], sla: Sla, *, verb: str = "measured"
) -> tuple[int | None, str]:
    """(highest concurrency meeting the SLA, a sentence saying which and why the next one missed).

    `verb` says how the levels were obtained: "measured" by a benchmark, "predicted" by the simulator.
    """
    closed = sorted(
        (lv for lv in levels if lv.get("concurrency") is not None), key=lambda lv: lv["concurrency"]
    )
    if not closed:
        return None, "no closed-loop levels to choose from"
    chosen: dict[str, Any] | None = None
    for level in closed:
        reasons = level_misses(level, sla)
        if reasons:
            miss = f"{level['concurrency']} misses: {'; '.join(reasons)}"
            if chosen is None:
                return None, f"no level meets the SLA ({sla.describe()}); the lowest, {miss}"
            return chosen[
                "concurrency"
            ], f"{chosen['concurrency']} is the highest level meeting the SLA; {miss}"
        chosen = level
    assert chosen is not None
    return chosen["concurrency"], (
        f"{chosen['concurrency']} is the highest level {verb} and meets the SLA ({sla.describe()}); "
        f"higher levels were not {verb}"
    )
