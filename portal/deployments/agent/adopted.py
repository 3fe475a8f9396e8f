"""Health checks of servers the portal did not start (`register_endpoint`): the state mirrors
what the server answers; there is no process to start, stop or restart."""

from __future__ import annotations

from django.utils import timezone

from inference import supervisor

from ..models import Deployment, DeploymentState, EventStatus, MetricsSample
from .steps import event


def adopted_check(deployment_id: int) -> str:
    """Health-check a server the portal did not start: state mirrors what it answers."""
    deployment = Deployment.objects.filter(pk=deployment_id, adopted=True).first()
    if deployment is None:
        return "not adopted"  # a check sent before the row changed: nothing to watch
    base, key = deployment.endpoint_url, deployment.engine_api_key
    healthy = supervisor.check_health(base, timeout_s=5, api_key=key)
    metrics = supervisor.scrape_metrics(base, timeout_s=5, api_key=key) if healthy else None
    MetricsSample.objects.create(
        deployment_id=deployment_id, healthy=healthy, **(metrics.to_dict() if metrics else {})
    )
    refused = healthy and supervisor.refuses_key(base, api_key=key, timeout_s=5)
    state = DeploymentState.SERVING if healthy and not refused else DeploymentState.FAILED
    reason = "" if state == DeploymentState.SERVING else f"{base}/health does not answer"
    if refused:
        reason = f"{base}/v1 refuses the registered API key (HTTP 401): register the server's key"
    if deployment.state != state:
        Deployment.objects.filter(pk=deployment_id, adopted=True).update(
            state=state, state_reason=reason, last_checked_at=timezone.now()
        )
        event(deployment_id, "health", EventStatus.OK if healthy else EventStatus.FAILED, reason or "answers")
    else:
        Deployment.objects.filter(pk=deployment_id).update(last_checked_at=timezone.now())
    return state
