"""The running acceptance as its steps see it: the record whose every write goes through its lease
(portal/core/jobs: the fencing token, and `state=running`), the context one step leaves for the
next, and the two ways a run stops early."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django.utils import timezone

from portal.core.jobs import Lease, LostLease
from portal.deployments.models import DeploymentProfile
from portal.inventory.models import NodeAcceptance
from portal.registry.models import ModelVersion

# The record is no longer this runner's: a later request declared the acceptance abandoned, or
# another runner took it over after this one stalled past its lease.
AcceptanceAbandoned = LostLease


class AcceptanceStepFailed(Exception):
    """A step could not do its work; `message` says why (recorded as the step's and the run's error)."""

    def __init__(self, message: str) -> None:
        self.message = message
        super().__init__(message)


@dataclass
class AcceptanceContext:
    """What one step leaves for the next (each field is set by the step named beside it)."""

    version: ModelVersion | None = None  # model: the reference model, registered
    deployment_id: int | None = None  # start: the reference deployment (stopped whatever happens)
    local_url: str = ""  # start: the engine on this node's loopback
    api_key: str | None = None  # start: the engine answers only its deployment's key
    profile: DeploymentProfile | None = None  # start: the reference profile
    measured: dict | None = None  # bench: the merged report (`manage.py bench --json`'s shape)
    predicted: list[dict] | None = None  # predict: the simulator's levels
    calibration_failed: str = ""  # calibrate: why there is no calibration ("" when fitted)

    # For the steps after the one that sets each (a missing one is a step out of order).
    @property
    def reference_version(self) -> ModelVersion:
        if self.version is None:
            raise RuntimeError("no reference model yet: the model step comes first")
        return self.version

    @property
    def reference_profile(self) -> DeploymentProfile:
        if self.profile is None:
            raise RuntimeError("no reference profile yet: the start step comes first")
        return self.profile

    @property
    def bench_report(self) -> dict[str, Any]:
        if self.measured is None:
            raise RuntimeError("no measured report yet: the bench step comes first")
        return self.measured


class RunningAcceptance:
    """The running record and its progress list; every write goes through the lease's fence."""

    def __init__(
        self, acceptance: NodeAcceptance, lease: Lease, on_progress: Callable[[dict], None] | None
    ) -> None:
        self.acceptance = acceptance
        self.lease = lease
        self.progress: list[dict] = list(acceptance.progress or [])
        self.on_progress = on_progress

    def write(self, **fields) -> None:
        """Update the record (renewing the lease); `AcceptanceAbandoned` when it is not ours any more."""
        self.lease.write(**fields)
        for name, value in fields.items():
            setattr(self.acceptance, name, value)

    def note(self, step: str, status: str, message: str = "", seconds: float | None = None) -> None:
        at = timezone.now().isoformat()
        entry: dict[str, Any] = {"step": step, "status": status, "message": message, "at": at}
        if seconds is not None:
            entry["seconds"] = round(seconds, 2)
        self.progress.append(entry)
        self.write(step=step, progress=self.progress)
        if self.on_progress is not None:
            self.on_progress(entry)

    def note_if_running(self, *args, **kwargs) -> None:
        """`note`, for the clean-up that runs even after the record was declared abandoned."""
        with contextlib.suppress(AcceptanceAbandoned):
            self.note(*args, **kwargs)

    def step(self, name: str, started: str, work: Callable[[], str], *, required: bool = True) -> str:
        """Record `name` started, run `work` (it returns the outcome message), record ok or failed.

        Returns "" when it succeeded; a step that is not `required` records its failure and returns
        its message (the run goes on)."""
        self.note(name, "started", started)
        began = time.monotonic()
        try:
            message = work()
        except AcceptanceStepFailed as failure:
            self.note(name, "failed", failure.message, time.monotonic() - began)
            if required:
                raise
            return failure.message
        self.note(name, "ok", message, time.monotonic() - began)
        return ""
