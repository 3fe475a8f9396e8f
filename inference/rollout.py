"""A rollout's rules without Django: its steps, and the verdict on one step's measurements.

The control task (portal/rollouts) reads the gateway's per-minute latency rollups of the new and
the old version over the same minutes, sums them into `Window`s and asks `judge` what to do. What
counts as a breach is written down in docs/decisions.md ("Rollouts: steps and what a breach is").
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from .errors import InputError

MAX_STEPS = 20
MAX_STEP_MINUTES = 24 * 60
MIN_STEP_SECONDS = 5  # steps in seconds are for tests and benchmarks; ops think in minutes
DEFAULT_STEPS: tuple[tuple[int, int], ...] = ((5, 10), (25, 10), (50, 10), (100, 10))


@dataclass(frozen=True)
class Step:
    share_percent: int  # the new version's share of the pair's traffic during the step
    minutes: int = 0  # how long the step must hold before the next one
    seconds: int = 0  # instead of minutes (short steps: tests, benchmarks)

    @property
    def duration_s(self) -> int:
        return self.seconds or self.minutes * 60

    def as_dict(self) -> dict:
        length = {"seconds": self.seconds} if self.seconds else {"minutes": self.minutes}
        return {"share_percent": self.share_percent, **length}

    def describe(self) -> str:
        return f"{self.seconds} s" if self.seconds else f"{self.minutes} min"


def _step_seconds(item: dict) -> Step:
    share, seconds = item.get("share_percent"), item.get("seconds")
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (share, seconds)):
        raise InputError("steps", "a step's share and seconds are whole numbers")
    if not MIN_STEP_SECONDS <= seconds <= MAX_STEP_MINUTES * 60:
        raise InputError(
            "steps", f"a step lasts {MIN_STEP_SECONDS} to {MAX_STEP_MINUTES * 60} seconds, not {seconds}"
        )
    return Step(share, seconds=seconds)


def _step_minutes(item: object) -> Step:
    if isinstance(item, dict):
        share, minutes = item.get("share_percent"), item.get("minutes")
    elif isinstance(item, list | tuple) and len(item) == 2:
        share, minutes = item
    else:
        raise InputError("steps", "each step is (share %, minutes)")
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (share, minutes)):
        raise InputError("steps", "a step's share and minutes are whole numbers")
    if not 1 <= minutes <= MAX_STEP_MINUTES:
        raise InputError("steps", f"a step lasts 1 to {MAX_STEP_MINUTES} minutes, not {minutes}")
    return Step(share, minutes)


def parse_steps(raw: object) -> tuple[Step, ...]:
    """[[5, 10], [25, 10], ...] or [{"share_percent": 5, "minutes": 10}, ...] → steps, checked:
    1..MAX_STEPS steps, shares rising strictly from 1 to 100 %, the last one 100 %, each step
    1..MAX_STEP_MINUTES minutes ({"share_percent": 5, "seconds": 20}: MIN_STEP_SECONDS and up)."""
    if not isinstance(raw, list | tuple) or not 1 <= len(raw) <= MAX_STEPS:
        raise InputError("steps", f"give 1 to {MAX_STEPS} steps of (share %, minutes)")
    steps: list[Step] = []
    for item in raw:
        step = _step_seconds(item) if isinstance(item, dict) and "seconds" in item else _step_minutes(item)
        if not 1 <= step.share_percent <= 100:
            raise InputError("steps", f"a step's share is 1 to 100 %, not {step.share_percent}")
        if steps and step.share_percent <= steps[-1].share_percent:
            raise InputError("steps", "each step's share must be larger than the one before")
        steps.append(step)
    if steps[-1].share_percent != 100:
        raise InputError("steps", "the last step must send 100 % (the promotion)")
    return tuple(steps)


@dataclass(frozen=True)
class Window:
    """One version's gateway measurements over some minutes: counts summed, the worst minute's P95."""

    requests: int = 0
    errors: int = 0
    p95_ttft_ms: float | None = None
    p95_tpot_ms: float | None = None

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0

    def as_dict(self) -> dict:
        return {
            "requests": self.requests,
            "errors": self.errors,
            "error_rate": round(self.error_rate, 4),
            "p95_ttft_ms": None if self.p95_ttft_ms is None else round(self.p95_ttft_ms, 1),
            "p95_tpot_ms": None if self.p95_tpot_ms is None else round(self.p95_tpot_ms, 1),
        }


@dataclass(frozen=True)
class Policy:
    sla_p95_ttft_ms: float
    sla_p95_tpot_ms: float
    min_requests: int  # evidence a step needs before it may pass, and before rates and ratios count
    max_error_rate_increase: float  # over the old version's rate, as a fraction (0.01: one point)
    max_latency_ratio: float  # the new P95 may be at most this many times the old one's


class Decision(enum.StrEnum):
    HOLD = "hold"  # nothing wrong; the step is not over (or has too little traffic to judge)
    ADVANCE = "advance"  # the step held for its minutes with enough requests
    ROLL_BACK = "roll_back"


@dataclass(frozen=True)
class Verdict:
    decision: Decision
    reasons: tuple[str, ...] = ()


def breaches(new: Window, old: Window, policy: Policy) -> list[str]:
    """Why the new version's window breaks the rollout's rules (empty: it does not)."""
    reasons = []
    # The SLA: any measured P95 over it is a breach, however few requests (safety first).
    if new.p95_ttft_ms is not None and new.p95_ttft_ms > policy.sla_p95_ttft_ms:
        reasons.append(f"P95 TTFT {new.p95_ttft_ms:.0f} ms > SLA {policy.sla_p95_ttft_ms:.0f} ms")
    if new.p95_tpot_ms is not None and new.p95_tpot_ms > policy.sla_p95_tpot_ms:
        reasons.append(f"P95 TPOT {new.p95_tpot_ms:.1f} ms > SLA {policy.sla_p95_tpot_ms:.1f} ms")
    if new.requests < policy.min_requests:
        return reasons
    if new.error_rate > old.error_rate + policy.max_error_rate_increase:
        reasons.append(
            f"error rate {new.error_rate:.1%} ({new.errors}/{new.requests}) > old version's "
            f"{old.error_rate:.1%} + {policy.max_error_rate_increase:.1%}"
        )
    if old.requests >= policy.min_requests:  # a comparison needs evidence on both sides
        for label, mine, theirs in (
            ("TTFT", new.p95_ttft_ms, old.p95_ttft_ms),
            ("TPOT", new.p95_tpot_ms, old.p95_tpot_ms),
        ):
            if mine is not None and theirs and mine > theirs * policy.max_latency_ratio:
                reasons.append(
                    f"P95 {label} {mine:.1f} ms > {policy.max_latency_ratio:g} × "
                    f"old version's {theirs:.1f} ms"
                )
    return reasons


def judge(*, new: Window, old: Window, policy: Policy, step: Step, elapsed_s: float) -> Verdict:
    """What to do with a step after `elapsed_s` of it, given both versions' windows since it began."""
    reasons = breaches(new, old, policy)
    if reasons:
        return Verdict(Decision.ROLL_BACK, tuple(reasons))
    if elapsed_s >= step.duration_s and new.requests >= policy.min_requests:
        return Verdict(Decision.ADVANCE)
    return Verdict(Decision.HOLD)


def split_share(total_bp: int, percent: int) -> tuple[int, int]:
    """(new, old) basis points when the new version takes `percent` of the pair's `total_bp`."""
    new = total_bp * percent // 100
    return new, total_bp - new
