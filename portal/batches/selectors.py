"""Reads of files, batches and lines; every team-facing read is scoped to the team."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from django.db.models import Count, Q, QuerySet
from django.utils import timezone

from .models import Batch, BatchFile, BatchLine, LineState

# The most rows one list call returns (OpenAI's `limit` is 1..100 for batches, 10,000 for files).
LIST_LIMIT_MAX = 100


def file_get_for_team(*, team_id: int, public_id: str) -> BatchFile | None:
    """The team's file, or None (another team's file does not exist for this one)."""
    return BatchFile.objects.filter(team_id=team_id, public_id=public_id).first()


def file_list_for_team(
    *, team_id: int, purpose: str = "", after: str = "", limit: int = LIST_LIMIT_MAX
) -> list[BatchFile]:
    """The team's files, newest first, from just after the file `after` (a cursor)."""
    files = BatchFile.objects.filter(team_id=team_id)
    if purpose:
        files = files.filter(purpose=purpose)
    return list(_after(files, BatchFile, team_id=team_id, after=after)[:limit])


def batch_get_for_team(*, team_id: int, public_id: str) -> Batch | None:
    """The team's batch, or None (another team's batch does not exist for this one)."""
    return (
        Batch.objects.select_related("input_file", "output_file", "error_file")
        .filter(team_id=team_id, public_id=public_id)
        .first()
    )


def batch_list_for_team(*, team_id: int, after: str = "", limit: int = LIST_LIMIT_MAX) -> list[Batch]:
    """The team's batches, newest first, from just after the batch `after` (OpenAI's cursor)."""
    batches = Batch.objects.select_related("input_file", "output_file", "error_file").filter(team_id=team_id)
    return list(_after(batches, Batch, team_id=team_id, after=after)[:limit])


def batch_list_all(*, limit: int = 500) -> QuerySet[Batch]:
    """Every team's batches, newest first (staff pages)."""
    return Batch.objects.select_related("team", "output_file", "error_file").order_by("-created_at", "-id")[
        :limit
    ]


def _after(rows: QuerySet, model, *, team_id: int, after: str) -> QuerySet:
    rows = rows.order_by("-created_at", "-id")
    if not after:
        return rows
    cursor = model.objects.filter(team_id=team_id, public_id=after).values("created_at", "id").first()
    if cursor is None:
        return rows.none()
    return rows.filter(
        Q(created_at__lt=cursor["created_at"]) | Q(created_at=cursor["created_at"], id__lt=cursor["id"])
    )


@dataclass(frozen=True)
class LineCounts:
    pending: int
    running: int
    succeeded: int
    failed: int
    cancelled: int

    @property
    def done(self) -> int:
        return self.succeeded + self.failed + self.cancelled


def batch_line_counts(*, batch_id: int) -> LineCounts:
    """How many of a batch's lines are in each state (one query)."""
    counts = BatchLine.objects.filter(batch_id=batch_id).aggregate(
        **{state.value: Count("id", filter=Q(state=state)) for state in LineState}
    )
    return LineCounts(**{state.value: counts[state.value] for state in LineState})


def batch_lines_done(*, batch_id: int) -> QuerySet[BatchLine]:
    """A batch's finished lines in line order (what its output and error files are built from)."""
    return BatchLine.objects.filter(
        batch_id=batch_id, state__in=[LineState.SUCCEEDED, LineState.FAILED]
    ).order_by("line_number")


def batches_paused() -> bool:
    """Whether staff paused all batch work."""
    from .models import BatchPause

    return BatchPause.objects.filter(pk=1, paused=True).exists()


@dataclass(frozen=True)
class Progress:
    """A batch's progress for its page: lines done of the total, the rate over the last minutes and
    the estimated finish at that rate (None when nothing finished lately, or nothing is left)."""

    done: int
    total: int
    lines_per_s: float
    eta: dt.datetime | None

    @property
    def percent(self) -> float:
        return 100.0 * self.done / self.total if self.total else 0.0


RATE_WINDOW = dt.timedelta(minutes=5)


def batch_progress(*, batch: Batch, now: dt.datetime | None = None) -> Progress:
    """Done lines (answered or failed) and the estimated finish at the rate of the last 5 minutes."""
    now = now or timezone.now()
    lines = BatchLine.objects.filter(batch_id=batch.pk)
    counts = lines.aggregate(
        done=Count("id", filter=Q(state__in=[LineState.SUCCEEDED, LineState.FAILED])),
        recent=Count(
            "id",
            filter=Q(finished_at__gte=now - RATE_WINDOW, state__in=[LineState.SUCCEEDED, LineState.FAILED]),
        ),
    )
    rate = counts["recent"] / RATE_WINDOW.total_seconds()
    left = batch.request_total - counts["done"]
    eta = now + dt.timedelta(seconds=left / rate) if rate and left > 0 else None
    return Progress(done=counts["done"], total=batch.request_total, lines_per_s=rate, eta=eta)
