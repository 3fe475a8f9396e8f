"""The deployment's timeline: each step writes a `DeploymentEvent` as it happens, so the
deployment page shows a start progressing and where it failed."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

from portal.core.jobs import Lease

from ..models import DeploymentEvent, EventStatus


class StepFailed(Exception):
    """A step that cannot go on; `code` is what the deployment's `failure_code` records."""

    def __init__(self, step: str, message: str, code: str = "") -> None:
        self.step, self.message, self.code = step, message, code or step
        super().__init__(message)


def event(
    target: Lease | int, step: str, status: str, message: str = "", seconds: float | None = None
) -> None:
    """Record a timeline event. Given the lease, through its fence: an agent that lost the
    deployment (stalled past its lease) adds nothing to the new holder's timeline."""
    if isinstance(target, Lease):
        with target.fenced():
            _create(target.target_id, step, status, message, seconds)
    else:
        _create(target, step, status, message, seconds)


def _create(deployment_id: int, step: str, status: str, message: str, seconds: float | None) -> None:
    DeploymentEvent.objects.create(
        deployment_id=deployment_id, step=step, status=status, message=message, seconds=seconds
    )


@contextlib.contextmanager
def step(lease: Lease, name: str, started: str = "") -> Iterator[dict[str, str]]:
    """Time a step and record it (fenced): "started" (when it says so), then ok or failed."""
    if started:
        event(lease, name, EventStatus.STARTED, started)
    began = time.monotonic()
    result = {"message": ""}
    try:
        yield result
    except StepFailed as failure:
        event(lease, name, EventStatus.FAILED, failure.message, time.monotonic() - began)
        raise
    event(lease, name, EventStatus.OK, result["message"], time.monotonic() - began)
