"""The lease on one deployment's process: who may act on it, and fencing of whoever lost it.

The lease is the job runner's (portal/core/jobs, docs/jobs.md) on the deployment's own row."""

from __future__ import annotations

import os
import socket
import time
from typing import Any

from django.conf import settings

from inference import supervisor
from portal.core.jobs import Lease, LostLease, claim

from ..models import Deployment

# What a deployment row says about its server once there is none (stopped, failed, restarting).
NO_PROCESS: dict[str, Any] = {
    "endpoint_url": "",
    "pid": None,
    "pgid": None,
    "process_identity": {},
    "serving_since": None,
}


# The deployments' name for the runner's error: another agent holds the deployment now (or it was
# ended under this one); whatever this one was doing is void.
LeaseLost = LostLease


def agent_owner(task_id: str | None = None) -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{task_id or 'direct'}"


def lease_acquire(deployment_id: int, *, owner: str, wait_s: float = 0.0) -> Lease | None:
    """Take the deployment's lease (portal/core/jobs) if it is free or expired; None if held.

    Every agent action on the process (start, stop, restart, move, supervision) takes it; `wait_s`
    lets an operator's stop wait out a supervision pass instead of giving up.
    """
    deadline = time.monotonic() + wait_s
    while True:
        lease = claim(Deployment, deployment_id, worker=owner, ttl_s=settings.DEPLOYMENT_LEASE_TTL_S)
        if lease is not None or time.monotonic() >= deadline:
            return lease
        time.sleep(0.5)


def deployment_load(deployment_id: int) -> Deployment:
    """The deployment with what every agent step reads (node, profile, model version, team)."""
    return Deployment.objects.select_related("node", "profile", "model_version", "team").get(pk=deployment_id)


def process_identity(deployment: Deployment) -> supervisor.ProcessIdentity | None:
    """Who the recorded pid/pgid was at launch; signals go to it only while it still is."""
    return supervisor.ProcessIdentity.from_dict(deployment.process_identity)
