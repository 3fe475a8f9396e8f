"""Move a deployment off a sick GPU, on the node it runs on: drain (the gateway stops routing to it
and in-flight requests finish), stop, then point it at the healthy GPUs, whose node's agent starts it
(portal/deployments/gpu_drain.py decided where)."""

from __future__ import annotations

from django.conf import settings

from portal.core.errors import ApplicationError

from ..gpu_drain import STEP, deployment_relocate
from ..models import DesiredState, EventStatus
from .lease import LeaseLost, deployment_load, lease_acquire
from .steps import StepFailed, event
from .stop import stop_under_lease


def deployment_move(
    deployment_id: int, *, owner: str, node_id: int, gpu_indices: list[int], reason: str
) -> str:
    lease = lease_acquire(deployment_id, owner=owner, wait_s=min(30, settings.DEPLOYMENT_LEASE_TTL_S))
    if lease is None:
        return "busy"
    try:
        deployment = deployment_load(deployment_id)
        if deployment.desired_state != DesiredState.RUNNING:
            event(lease, STEP, EventStatus.SKIPPED, "not moved: it was stopped meanwhile")
            return "not running"
        if deployment.node_id == node_id and sorted(deployment.gpu_indices) == sorted(gpu_indices):
            return "already there"
        stop_under_lease(lease, deployment, drain=True, reason=f"moving off a sick GPU: {reason}"[:500])
        lease.renew()
        try:
            deployment_relocate(
                deployment_id=deployment_id, node_id=node_id, gpu_indices=gpu_indices, reason=reason
            )
        except ApplicationError as error:
            # Stopped, still wanted running where it was: the next health sample decides again.
            event(lease, STEP, EventStatus.FAILED, f"not moved: the target was refused: {error.message}")
            return "target refused"
        return "moved"
    except StepFailed:
        return "failed"
    except LeaseLost:
        return "lease lost"
    finally:
        lease.release()
