"""Reads for the batch pages and the ops dashboard: each batch's row (progress, why it waits) and the
batch load per model. Lines carry no deployment; a model's lines go to the deployments serving it."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from django.db.models import Count, Q
from django.db.models.fields.json import KT

from .models import Batch, BatchLine, BatchStatus, LineState, WaitReason
from .selectors import Progress, batch_progress, batches_paused

ACTIVE = (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS, BatchStatus.FINALIZING, BatchStatus.CANCELLING)


@dataclass(frozen=True)
class BatchRow:
    """One batch as its pages show it."""

    batch: Batch
    progress: Progress
    waiting: str  # why it does not run now ("" when it runs or has ended)
    cancellable: bool


def _waiting(batch: Batch, *, paused: bool) -> str:
    if batch.status not in ACTIVE:
        return ""
    if paused:
        return WaitReason.PAUSED.label
    if not batch.wait_reason:
        return ""
    label = WaitReason(batch.wait_reason).label
    if batch.wait_reason == WaitReason.DAILY_BUDGET:
        return f"{label}: waits until tomorrow (UTC)"
    if batch.wait_until:
        return f"{label}: waits until {batch.wait_until:%Y-%m-%d %H:%M} UTC"
    return label


def batch_rows(batches: list[Batch], *, now: dt.datetime | None = None) -> list[BatchRow]:
    """Each batch with its progress and wait reason (a few queries per batch: pages list at most 100)."""
    paused = batches_paused()
    return [
        BatchRow(
            batch=batch,
            progress=batch_progress(batch=batch, now=now),
            waiting=_waiting(batch, paused=paused),
            cancellable=batch.status in (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS),
        )
        for batch in batches
    ]


@dataclass(frozen=True)
class ModelLoad:
    model: str
    in_flight: int  # lines sent to the gateway, not yet answered
    queued: int  # lines of running batches not yet sent


def batch_load_by_model() -> list[ModelLoad]:
    """Batch lines in flight and queued per model (one query), busiest first."""
    rows = (
        BatchLine.objects.filter(
            batch__status__in=[BatchStatus.IN_PROGRESS, BatchStatus.CANCELLING],
            state__in=[LineState.PENDING, LineState.RUNNING],
        )
        .annotate(model=KT("body__model"))
        .values("model")
        .annotate(
            in_flight=Count("id", filter=Q(state=LineState.RUNNING)),
            queued=Count("id", filter=Q(state=LineState.PENDING)),
        )
        .order_by("-in_flight", "-queued", "model")
    )
    return [ModelLoad(model=r["model"] or "?", in_flight=r["in_flight"], queued=r["queued"]) for r in rows]
