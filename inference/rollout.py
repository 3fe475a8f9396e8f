"""A rollout's rules without Django: its steps, and the verdict on one step's measurements.

The control task (portal/rollouts) reads the gateway's per-minute latency rollups of the new and
the old version over the same minutes, sums them into `Window`s and asks `judge` what to do. What
counts as a breach is written down in docs/decisions.md ("Rollouts: steps and what a breach is").
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, TypeGuard

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

    def as_dict(self) -> dict[str, Any]:
        length = {"seconds": self.seconds} if self.seconds else {"minutes": self.minutes}
        return {"share_percent": self.share_percent, **length}

    def describe(self) -> str:
        return f"{self.seconds} s" if self.seconds else f"{self.minutes} min"


def _whole(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _step_seconds(item: dict[str, Any]) -> Step:
    share, seconds = item.get("share_percent"), item.get("seconds")
    if not (_whole(share) and _whole(seconds)):
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
    if not (_whole(share) and _whole(minutes)):
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

    def as_dict(self) -> dict[str, Any]:
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
    min_requests: int  # evidence each side needs before rates and comparisons count, and a step may pass
    max_error_rate_increase: float  # over the old version's rate, as a fraction (0.01: one point)
    max_latency_ratio: float  # the new P95 may be at most this many times the old one's ...
    # ... and only counts when it is also this much slower in absolute terms: the larger of a
    # fraction of the SLA and a floor in ms (tens of ms on a busy node are noise, not a regression).
    latency_margin_sla_fraction: float = 0.1
    latency_margin_min_ms: float = 50.0
    # An error rate at or above this fails the step whatever the old version does; both versions at
    # or above it is an outage (the rollout pauses), not a verdict on the new one.
    max_error_rate: float = 0.05
    compare_sla_only: bool = False  # other hardware: judge the new version on the SLA alone

    def latency_margin_ms(self, sla_ms: float) -> float:
        return max(sla_ms * self.latency_margin_sla_fraction, self.latency_margin_min_ms)


class Decision(enum.StrEnum):
    HOLD = "hold"  # nothing wrong; the step is not over (or has too little traffic to judge)
    ADVANCE = "advance"  # the step held for its minutes with enough requests
    ROLL_BACK = "roll_back"
    PAUSE = "pause"  # both versions fail: an outage, not a verdict on the new version


class Rule(enum.StrEnum):
    """The rule that decided a step's verdict (recorded with the numbers it used)."""

    SLA = "sla"
    ERROR_CEILING = "error_ceiling"
    ERROR_INCREASE = "error_increase"
    SLOWER_THAN_OLD = "slower_than_old"
    OUTAGE = "outage"
    TOO_FEW_REQUESTS = "too_few_requests"
    STEP_NOT_OVER = "step_not_over"
    STEP_PASSED = "step_passed"


RULE_TEXT = {
    Rule.SLA: "a P95 over the SLA rolls back",
    Rule.ERROR_CEILING: "an error rate at or over the ceiling rolls back",
    Rule.ERROR_INCREASE: "an error rate above the old version's by more than the allowed increase rolls back",
    Rule.SLOWER_THAN_OLD: "a P95 over the ratio and the margin above the old version's rolls back",
    Rule.OUTAGE: "both versions failing pauses the rollout: an outage, not a verdict",
    Rule.TOO_FEW_REQUESTS: "a step passes only with enough requests",
    Rule.STEP_NOT_OVER: "a step passes only once its time is over",
    Rule.STEP_PASSED: "the step held its time with enough requests and no breach",
}


@dataclass(frozen=True)
class Verdict:
    decision: Decision
    reasons: tuple[str, ...] = ()
    rule: Rule = Rule.STEP_NOT_OVER


def _failing(window: Window, policy: Policy) -> bool:
    return window.requests >= policy.min_requests and window.error_rate >= policy.max_error_rate


def breaches(new: Window, old: Window, policy: Policy) -> list[tuple[Rule, str]]:
    """Why the new version's window breaks the rollout's rules (empty: it does not), each with its rule."""
    found: list[tuple[Rule, str]] = []
    # The SLA: any measured P95 over it is a breach, however few requests (safety first).
    if new.p95_ttft_ms is not None and new.p95_ttft_ms > policy.sla_p95_ttft_ms:
        found.append((Rule.SLA, f"P95 TTFT {new.p95_ttft_ms:.0f} ms > SLA {policy.sla_p95_ttft_ms:.0f} ms"))
    if new.p95_tpot_ms is not None and new.p95_tpot_ms > policy.sla_p95_tpot_ms:
        found.append((Rule.SLA, f"P95 TPOT {new.p95_tpot_ms:.1f} ms > SLA {policy.sla_p95_tpot_ms:.1f} ms"))
    if new.requests < policy.min_requests:
        return found
    if new.error_rate >= policy.max_error_rate:
        found.append(
            (
                Rule.ERROR_CEILING,
                f"error rate {new.error_rate:.1%} ({new.errors}/{new.requests}) ≥ ceiling "
                f"{policy.max_error_rate:.1%}",
            )
        )
    # Comparisons need evidence on both sides (and are left out against other hardware).
    if policy.compare_sla_only or old.requests < policy.min_requests:
        return found
    if new.error_rate > old.error_rate + policy.max_error_rate_increase:
        found.append(
            (
                Rule.ERROR_INCREASE,
                f"error rate {new.error_rate:.1%} ({new.errors}/{new.requests}) > old version's "
                f"{old.error_rate:.1%} + {policy.max_error_rate_increase:.1%}",
            )
        )
    for label, mine, theirs, sla in (
        ("TTFT", new.p95_ttft_ms, old.p95_ttft_ms, policy.sla_p95_ttft_ms),
        ("TPOT", new.p95_tpot_ms, old.p95_tpot_ms, policy.sla_p95_tpot_ms),
    ):
        if mine is None or not theirs:
            continue
        margin = policy.latency_margin_ms(sla)
        if mine > theirs * policy.max_latency_ratio and mine - theirs > margin:
            found.append(
                (
                    Rule.SLOWER_THAN_OLD,
                    f"P95 {label} {mine:.1f} ms > {policy.max_latency_ratio:g} × old version's "
                    f"{theirs:.1f} ms and {mine - theirs:.1f} ms over it > margin {margin:.0f} ms",
                )
            )
    return found


def judge(*, new: Window, old: Window, policy: Policy, step: Step, elapsed_s: float) -> Verdict:
    """What to do with a step after `elapsed_s` of it, given both versions' windows over the same
    minutes since it began."""
    if _failing(new, policy) and _failing(old, policy):
        return Verdict(
            Decision.PAUSE,
            (
                f"outage: both versions fail — new {new.error_rate:.1%} ({new.errors}/{new.requests}), "
                f"old {old.error_rate:.1%} ({old.errors}/{old.requests}), "
                f"ceiling {policy.max_error_rate:.1%}",
            ),
            Rule.OUTAGE,
        )
    found = breaches(new, old, policy)
    if found:
        return Verdict(Decision.ROLL_BACK, tuple(text for _, text in found), found[0][0])
    if new.requests < policy.min_requests:
        return Verdict(
            Decision.HOLD, (f"{new.requests} of {policy.min_requests} requests",), Rule.TOO_FEW_REQUESTS
        )
    if elapsed_s < step.duration_s:
        return Verdict(Decision.HOLD, (f"{elapsed_s:.0f} of {step.duration_s} s",), Rule.STEP_NOT_OVER)
    return Verdict(Decision.ADVANCE, (), Rule.STEP_PASSED)


@dataclass(frozen=True)
class Evaluation:
    """One step's judgement as stored and shown: the numbers, the limits and the rule that decided."""

    step: int
    elapsed_s: int
    new: Window
    old: Window
    decision: Decision
    rule: Rule
    reasons: tuple[str, ...]
    sla_p95_ttft_ms: float
    sla_p95_tpot_ms: float
    compare_sla_only: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "elapsed_s": self.elapsed_s,
            "new": self.new.as_dict(),
            "old": self.old.as_dict(),
            "decision": self.decision.value,
            "rule": self.rule.value,
            "reasons": list(self.reasons),
            "sla_p95_ttft_ms": self.sla_p95_ttft_ms,
            "sla_p95_tpot_ms": self.sla_p95_tpot_ms,
            "compare_sla_only": self.compare_sla_only,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Evaluation | None:
        """The stored record back (None for one written before the rule was recorded, or empty)."""
        try:
            windows = [
                Window(
                    requests=int(data[side]["requests"]),
                    errors=int(data[side]["errors"]),
                    p95_ttft_ms=data[side]["p95_ttft_ms"],
                    p95_tpot_ms=data[side]["p95_tpot_ms"],
                )
                for side in ("new", "old")
            ]
            return cls(
                step=int(data["step"]),
                elapsed_s=int(data["elapsed_s"]),
                new=windows[0],
                old=windows[1],
                decision=Decision(data["decision"]),
                rule=Rule(data["rule"]),
                reasons=tuple(data.get("reasons", ())),
                sla_p95_ttft_ms=float(data["sla_p95_ttft_ms"]),
                sla_p95_tpot_ms=float(data["sla_p95_tpot_ms"]),
                compare_sla_only=bool(data.get("compare_sla_only", False)),
            )
        except (KeyError, TypeError, ValueError):
            return None

    def describe(self) -> str:
        def side(label: str, w: Window) -> str:
            ttft = "—" if w.p95_ttft_ms is None else f"{w.p95_ttft_ms:.0f} ms"
            tpot = "—" if w.p95_tpot_ms is None else f"{w.p95_tpot_ms:.1f} ms"
            return (
                f"{label}: {w.requests} requests, {w.errors} errors ({w.error_rate:.1%}), "
                f"P95 TTFT {ttft}, P95 TPOT {tpot}"
            )

        why = "; ".join(self.reasons)
        basis = " (compared against the SLA only)" if self.compare_sla_only else ""
        return (
            f"Step {self.step + 1} after {self.elapsed_s} s: {self.decision.value.replace('_', ' ')} — "
            f"{RULE_TEXT[self.rule]}{basis}" + (f": {why}" if why else "") + ". "
            f"{side('New', self.new)}. {side('Old', self.old)}. "
            f"SLA: P95 TTFT {self.sla_p95_ttft_ms:.0f} ms, P95 TPOT {self.sla_p95_tpot_ms:.0f} ms."
        )


def split_share(total_bp: int, percent: int) -> tuple[int, int]:
    """(new, old) basis points when the new version takes `percent` of the pair's `total_bp`."""
    new = total_bp * percent // 100
    return new, total_bp - new
