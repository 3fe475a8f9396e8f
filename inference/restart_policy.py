"""When to restart an inference server: the decisions, without Django.

After a crash or a hang, a restart follows an exponential backoff, up to a limit in a row
(`crash_restart`); a healthy server is restarted on purpose when its deployment's policy says so
(`planned_restart_reason`: uptime, preemptions, memory growth). The portal's half
(portal/deployments/agent/restart_policy.py) reads the settings and the deployment's row, writes
the outcome and sends the start; everything decided here is plain arithmetic on what it is given.
"""

from __future__ import annotations

from dataclasses import dataclass

# A pending start older than the longest backoff by this much was lost, not scheduled.
PENDING_RESCUE_MARGIN_S = 120


@dataclass(frozen=True)
class CrashRestart:
    """What to do after a crash: restart number `attempt` after `delay_s`, or give up (delay_s None)."""

    attempt: int
    limit: int
    delay_s: float | None


def crash_restart(restarts_in_a_row: int, *, limit: int, base_s: float) -> CrashRestart:
    """The next automatic restart after `restarts_in_a_row` earlier ones, or none past `limit`."""
    attempt = restarts_in_a_row + 1
    delay = None if attempt > limit else restart_backoff_s(attempt, base_s=base_s)
    return CrashRestart(attempt=attempt, limit=limit, delay_s=delay)


def pending_rescue_s(*, limit: int, base_s: float) -> float:
    """How long a wanted start may stay pending before it is sent again: longer than the longest
    backoff, so a scheduled restart is never doubled."""
    return restart_backoff_s(limit, base_s=base_s) + PENDING_RESCUE_MARGIN_S


def preemptions_since_start(preemptions: float | None, baseline: float | None) -> float | None:
    """The preemptions counted since the server started (None when either reading is missing)."""
    if preemptions is None or baseline is None:
        return None
    return preemptions - baseline


@dataclass(frozen=True)
class RestartPolicy:
    """When to restart a healthy server on purpose (docs/v100-field-guide.md#operating-habits:
    memory creeps after
    ~48 h, preemption storms when KV headroom collapses). None disables a rule."""

    max_uptime_hours: float | None = None
    max_preemptions: float | None = None  # since the server started
    max_memory_growth: float | None = None  # fraction over the memory first seen serving, e.g. 0.2


def planned_restart_reason(
    policy: RestartPolicy,
    *,
    uptime_s: float,
    preemptions_since_start: float | None,
    memory_mb: float | None,
    baseline_memory_mb: float | None,
) -> str:
    """Why the policy wants a restart now ("" when it does not)."""
    if policy.max_uptime_hours is not None and uptime_s >= policy.max_uptime_hours * 3600:
        return f"up {uptime_s / 3600:.1f} h (policy: restart after {policy.max_uptime_hours:g} h)"
    if (
        policy.max_preemptions is not None
        and preemptions_since_start is not None
        and preemptions_since_start >= policy.max_preemptions
    ):
        return (
            f"{preemptions_since_start:.0f} preemptions since start "
            f"(policy: restart at {policy.max_preemptions:g})"
        )
    if (
        policy.max_memory_growth is not None
        and memory_mb is not None
        and baseline_memory_mb
        and memory_mb >= baseline_memory_mb * (1 + policy.max_memory_growth)
    ):
        growth = memory_mb / baseline_memory_mb - 1
        return (
            f"memory grew {growth:.0%} ({baseline_memory_mb:.0f} → {memory_mb:.0f} MiB; "
            f"policy: restart at {policy.max_memory_growth:.0%})"
        )
    return ""


def restart_backoff_s(attempt: int, *, base_s: float, cap_s: float = 600.0) -> float:
    """Exponential backoff before automatic restart number `attempt` (1, 2, 3, …)."""
    return min(cap_s, base_s * 2.0 ** max(0, attempt - 1))
