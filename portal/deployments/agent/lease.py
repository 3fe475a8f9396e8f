"""The lease on one deployment's process: who may act on it, and fencing of whoever lost it."""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import F, Q
from django.utils import timezone

from inference import supervisor

from ..models import Deployment

# What a deployment row says about its server once there is none (stopped, failed, restarting).
NO_PROCESS: dict[str, Any] = {
    "endpoint_url": "",
    "pid": None,
    "pgid": None,
    "process_identity": {},
    "serving_since": None,
}


class LeaseLost(Exception):
    """Another agent holds the deployment now; whatever this one was doing is void."""


def agent_owner(task_id: str | None = None) -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{task_id or 'direct'}"


@dataclass
class Lease:
    """The right to act on one deployment's process until `lease_expires_at`.

    `token` is the fencing token: every write goes through `write`, which matches
    the row only while its `lease_token` is still ours.
    """

    deployment_id: int
    token: int
    owner: str

    def write(self, **fields) -> None:
        now = timezone.now()
        fields.setdefault("lease_expires_at", now + timedelta(seconds=settings.DEPLOYMENT_LEASE_TTL_S))
        fields["updated_at"] = now
        updated = Deployment.objects.filter(pk=self.deployment_id, lease_token=self.token).update(**fields)
        if updated != 1:
            raise LeaseLost(f"deployment {self.deployment_id}: lease {self.token} was taken over")

    def renew(self) -> None:
        self.write()

    def release(self) -> None:
        Deployment.objects.filter(pk=self.deployment_id, lease_token=self.token).update(
            lease_owner="", lease_expires_at=None
        )


def lease_acquire(deployment_id: int, *, owner: str, wait_s: float = 0.0) -> Lease | None:
    """Take the lease if it is free or expired (bumping the fencing token); None if held.

    One conditional UPDATE is the claim: PostgreSQL re-checks the WHERE clause on
    the row a concurrent claimer just committed, so exactly one of two wins.
    """
    deadline = time.monotonic() + wait_s
    while True:
        now = timezone.now()
        with transaction.atomic():
            claimed = (
                Deployment.objects.filter(pk=deployment_id)
                .filter(Q(lease_expires_at__isnull=True) | Q(lease_expires_at__lt=now))
                .update(
                    lease_token=F("lease_token") + 1,
                    lease_owner=owner,
                    lease_expires_at=now + timedelta(seconds=settings.DEPLOYMENT_LEASE_TTL_S),
                )
            )
            # Read inside the transaction: the token we just wrote, not a later claimer's.
            if claimed == 1:
                token = Deployment.objects.values_list("lease_token", flat=True).get(pk=deployment_id)
                return Lease(deployment_id=deployment_id, token=token, owner=owner)
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.5)


def deployment_load(deployment_id: int) -> Deployment:
    """The deployment with what every agent step reads (node, profile, model version, team)."""
    return Deployment.objects.select_related("node", "profile", "model_version", "team").get(pk=deployment_id)


def process_identity(deployment: Deployment) -> supervisor.ProcessIdentity | None:
    """Who the recorded pid/pgid was at launch; signals go to it only while it still is."""
    return supervisor.ProcessIdentity.from_dict(deployment.process_identity)
