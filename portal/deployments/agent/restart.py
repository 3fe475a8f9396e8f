"""An operator's restart: drain and stop, then start again, under one lease (nobody can slip in
between)."""

from __future__ import annotations

from django.conf import settings

from ..models import DesiredState, EventStatus
from .lease import LeaseLost, deployment_load, lease_acquire
from .start import start_under_lease
from .steps import StepFailed, event
from .stop import stop_under_lease


def deployment_restart(deployment_id: int, *, owner: str, reason: str = "restart requested") -> str:
    lease = lease_acquire(deployment_id, owner=owner, wait_s=min(30, settings.DEPLOYMENT_LEASE_TTL_S))
    if lease is None:
        return "busy"
    try:
        deployment = deployment_load(deployment_id)
        if deployment.adopted or deployment.desired_state != DesiredState.RUNNING:
            return "not restarted"
        event(deployment_id, "restart", EventStatus.STARTED, reason)
        stop_under_lease(lease, deployment, drain=True, reason=f"restarting: {reason}")
        return start_under_lease(lease, reason=f"restart: {reason}")
    except StepFailed:
        return "failed"
    except LeaseLost:
        return "lease lost"
    finally:
        lease.release()
