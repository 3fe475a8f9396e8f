"""The periodic supervision pass over this node's deployments (a beat tick, run on the node):
bring each to its desired state, check a serving one's health, record a metrics sample, rotate
its log, and hand crashes, hangs and policy limits to the restart policy."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.conf import settings
from django.utils import timezone

from inference import server_log, supervisor

from ..models import Deployment, DeploymentState, DesiredState, EventStatus, MetricsSample
from .environment import address_check, local_url
from .lease import Lease, LeaseLost, deployment_load, lease_acquire, process_identity
from .restart_policy import pending_rescue_s, planned_restart, restart_schedule, start_enqueue
from .start import LOG_NAME
from .steps import StepFailed, event
from .stop import stop_under_lease


def node_supervise(node_name: str, *, owner: str) -> dict[str, str]:
    """One supervision pass over the node's deployments; deployment name → what was done."""
    deployments = (
        Deployment.objects.filter(node__name=node_name, adopted=False)
        .exclude(desired_state=DesiredState.STOPPED, state=DeploymentState.STOPPED)
        .values_list("pk", "name")
    )
    results = {}
    for pk, name in deployments:
        try:
            results[name] = deployment_supervise(pk, owner=owner)
        except LeaseLost:
            results[name] = "lease lost"
    return results


def deployment_supervise(deployment_id: int, *, owner: str) -> str:
    lease = lease_acquire(deployment_id, owner=owner)
    if lease is None:
        return "busy"  # a start, stop or restart is at work on it
    try:
        return _supervise(lease, deployment_load(deployment_id))
    except StepFailed:
        return "failed"
    finally:
        lease.release()


def _supervise(lease: Lease, deployment: Deployment) -> str:
    state = deployment.state
    if deployment.desired_state == DesiredState.STOPPED:
        return stop_under_lease(lease, deployment, drain=False, reason="stopped")
    if state == DeploymentState.FAILED:
        return "failed: not restarted"  # a classified failure repeats; an operator must act
    if state in (DeploymentState.STARTING, DeploymentState.STOPPING, DeploymentState.DRAINING):
        # We hold the lease, so the agent that was doing this is gone (its lease expired).
        return restart_schedule(lease, deployment, f"the agent was interrupted while {state}")
    if state in (DeploymentState.PENDING, DeploymentState.STOPPED):
        requested = deployment.start_requested_at
        stale = requested is None or timezone.now() - requested > timedelta(seconds=pending_rescue_s())
        if stale:
            # The start message expired or was lost (agent down when it was sent).
            start_enqueue(deployment, reason="supervision: wanted running, no start in flight")
            return "start enqueued"
        return "start pending"
    return _check_serving(lease, deployment)


def _address_problem(deployment: Deployment) -> str:
    """Why the gateway's address may not answer, where the name is the reason ("" otherwise)."""
    try:
        address_check(deployment.placed_node)
    except StepFailed as failure:
        return f": {failure.message}"
    return ""


def _check_serving(lease: Lease, deployment: Deployment) -> str:
    did = deployment.pk
    if not supervisor.process_alive(deployment.pid, process_identity(deployment)):
        tail = server_log.log_tail(deployment.log_path, lines=40)
        lease.write(log_tail=tail)
        return restart_schedule(lease, deployment, f"the server process {deployment.pid} is gone")
    base = local_url(deployment)
    key = deployment.engine_api_key
    healthy = supervisor.check_health(base, timeout_s=5, api_key=key)
    metrics = supervisor.scrape_metrics(base, timeout_s=5, api_key=key) if healthy else None
    memory = supervisor.group_rss_mb(deployment.pgid, process_identity(deployment))
    if server_log.rotate_log(
        deployment.log_path, max_bytes=settings.ENGINE_LOG_MAX_BYTES, keep=settings.ENGINE_LOG_KEEP
    ):
        event(lease, "log", EventStatus.INFO, f"{LOG_NAME} rotated at {settings.ENGINE_LOG_MAX_BYTES} bytes")
    values = metrics.to_dict() if metrics is not None else {}
    now = timezone.now()
    with lease.fenced():  # a pass that lost the deployment records no sample beside the new holder's
        MetricsSample.objects.create(deployment_id=did, healthy=healthy, memory_mb=memory, **values)
        # Old samples go as new ones arrive (one per tick); the daily retention prune catches the rest.
        if settings.RETENTION_METRICS_SAMPLES_DAYS:
            kept = timedelta(days=settings.RETENTION_METRICS_SAMPLES_DAYS)
            MetricsSample.objects.filter(deployment_id=did, at__lt=now - kept).delete()
    if not healthy:
        failures = deployment.health_failures + 1
        lease.write(health_failures=failures, last_checked_at=now)
        if failures >= settings.DEPLOYMENT_HEALTH_FAILURES:
            return restart_schedule(lease, deployment, f"/health failed {failures} times in a row (hung)")
        event(
            lease,
            "health",
            EventStatus.FAILED,
            f"/health did not answer at {base} ({failures} in a row){_address_problem(deployment)}",
        )
        return "unhealthy"
    updates: dict[str, Any] = {
        "health_failures": 0,
        "last_checked_at": now,
        "log_tail": server_log.log_tail(deployment.log_path),
    }
    if deployment.baseline_memory_mb is None and memory is not None:
        updates["baseline_memory_mb"] = memory
    if deployment.baseline_preemptions is None and metrics is not None and metrics.preemptions is not None:
        updates["baseline_preemptions"] = metrics.preemptions
    uptime = (now - deployment.serving_since).total_seconds() if deployment.serving_since else 0.0
    if deployment.restart_count and uptime > 600:
        updates["restart_count"] = 0  # ten quiet minutes: the next crash starts the backoff afresh
    lease.write(**updates)
    reason = planned_restart(
        lease,
        deployment,
        uptime_s=uptime,
        metrics=metrics,
        memory_mb=memory,
        baseline_preemptions=updates.get("baseline_preemptions", deployment.baseline_preemptions),
        baseline_memory_mb=updates.get("baseline_memory_mb", deployment.baseline_memory_mb),
    )
    return "planned restart" if reason else "healthy"
