"""Automatic restarts: after a crash or a hang (with a backoff, up to a limit in a row), and the
planned ones a deployment's policy asks for (uptime, preemptions, memory growth).

The decisions are inference/restart_policy.py's; this half reads the settings and the deployment's
row, records the outcome and sends the start or restart."""

from __future__ import annotations

from django.conf import settings
from django.utils import timezone

from inference import restart_policy, supervisor
from inference.vllm_metrics import VllmMetrics

from ..dispatch import send_to_node
from ..models import Deployment, DeploymentState, EventStatus
from .lease import NO_PROCESS, Lease, process_identity
from .steps import event


def restart_schedule(lease: Lease, deployment: Deployment, why: str) -> str:
    """Kill what is left of the server and start again after a backoff, up to the limit."""
    if supervisor.group_alive(deployment.pgid, process_identity(deployment)):
        supervisor.stop_group(deployment.pgid, grace_s=5, identity=process_identity(deployment))
    decision = restart_policy.crash_restart(
        deployment.restart_count,
        limit=settings.DEPLOYMENT_RESTART_LIMIT,
        base_s=settings.DEPLOYMENT_RESTART_BACKOFF_S,
    )
    attempt, limit, delay = decision.attempt, decision.limit, decision.delay_s
    if delay is None:
        message = f"{why}; restarted {limit} times in a row already, so not again"
        lease.write(
            state=DeploymentState.FAILED,
            state_reason=message,
            failure_code="restart_limit",
            **NO_PROCESS,
        )
        event(lease, "failed", EventStatus.FAILED, message)
        return "failed"
    message = f"{why}; restart {attempt} of {limit} in {delay:.0f} s"
    lease.write(
        state=DeploymentState.PENDING,
        state_reason=message,
        restart_count=attempt,
        **NO_PROCESS,
        start_requested_at=timezone.now(),
    )
    event(lease, "supervise", EventStatus.FAILED, message)
    start_enqueue(deployment, reason=f"automatic restart {attempt}: {why}", countdown=delay)
    return "restart scheduled"


def start_enqueue(deployment: Deployment, *, reason: str, countdown: float = 0) -> None:
    # After commit: in a task (autocommit) it is sent at once; inside a transaction, after it commits.
    send_to_node(
        deployment.placed_node,
        "deployments.start",
        args=[deployment.pk],
        kwargs={"reason": reason},
        countdown=countdown,
    )


def pending_rescue_s() -> float:
    """How long a wanted start may stay pending before supervision sends it again: longer than the
    longest backoff, so a scheduled restart is never doubled."""
    return restart_policy.pending_rescue_s(
        limit=settings.DEPLOYMENT_RESTART_LIMIT, base_s=settings.DEPLOYMENT_RESTART_BACKOFF_S
    )


def planned_restart(
    lease: Lease,
    deployment: Deployment,
    *,
    uptime_s: float,
    metrics: VllmMetrics | None,
    memory_mb: float | None,
    baseline_preemptions: float | None,
    baseline_memory_mb: float | None,
) -> str | None:
    """The reason the deployment's restart policy asks for a restart now (and the restart sent),
    or None."""
    policy = restart_policy.RestartPolicy(
        max_uptime_hours=deployment.restart_after_hours,
        max_preemptions=deployment.restart_max_preemptions,
        max_memory_growth=deployment.restart_max_memory_growth,
    )
    reason = restart_policy.planned_restart_reason(
        policy,
        uptime_s=uptime_s,
        preemptions_since_start=restart_policy.preemptions_since_start(
            metrics.preemptions if metrics is not None else None, baseline_preemptions
        ),
        memory_mb=memory_mb,
        baseline_memory_mb=baseline_memory_mb,
    )
    if reason:
        event(lease, "planned restart", EventStatus.INFO, reason)
        kwargs = {"reason": f"planned: {reason}"}
        send_to_node(deployment.placed_node, "deployments.restart", args=[deployment.pk], kwargs=kwargs)
    return reason
