"""Writes: files, batches and their state changes. Every state change is a claim
(`UPDATE … WHERE status=<expected>`, the row count checked), so two workers, or a worker and a
cancel, never both move a batch (docs/batches.md)."""

from __future__ import annotations

import datetime as dt
import json

from django.conf import settings
from django.core.files.base import ContentFile
from django.core.files.storage import default_storage
from django.db import transaction
from django.utils import timezone

from portal.core.errors import ApplicationError
from portal.teams.models import ApiKey, Team

from .models import (
    TERMINAL_STATUSES,
    Batch,
    BatchEndpoint,
    BatchFile,
    BatchLine,
    BatchStatus,
    FilePurpose,
    LineState,
)

# OpenAI accepts only "24h" (docs: completion_window).
COMPLETION_WINDOWS = {"24h": dt.timedelta(hours=24)}
METADATA_MAX_PAIRS, METADATA_KEY_MAX, METADATA_VALUE_MAX = 16, 64, 512
FILENAME_MAX = 255


def _file_expiry(now: dt.datetime) -> dt.datetime | None:
    days = settings.BATCH_FILE_RETENTION_DAYS
    return now + dt.timedelta(days=days) if days else None


def file_create(*, team: Team, filename: str, content: bytes, purpose: str) -> BatchFile:
    """Store `content` through default_storage under the team's prefix and record it."""
    if purpose not in FilePurpose.values:
        raise ApplicationError(f"purpose must be `batch`, not `{purpose[:40]}`.", field="purpose")
    if len(content) > settings.BATCH_FILE_MAX_BYTES:
        raise ApplicationError(
            f"The file is over BATCH_FILE_MAX_BYTES ({settings.BATCH_FILE_MAX_BYTES} bytes).", field="file"
        )
    filename = (filename or "upload.jsonl").replace("\x00", "")[-FILENAME_MAX:]
    now = timezone.now()
    row = BatchFile(
        team=team, purpose=purpose, filename=filename, bytes=len(content), expires_at=_file_expiry(now)
    )
    # The storage name is the public id (never the client's filename): no path tricks, no clashes.
    row.storage_name = default_storage.save(f"batches/{team.pk}/{row.public_id}", ContentFile(content))
    try:
        row.save()
    except Exception:
        default_storage.delete(row.storage_name)
        raise
    return row


def file_read(*, file: BatchFile) -> bytes:
    with default_storage.open(file.storage_name, "rb") as handle:
        return handle.read()


def file_delete(*, file: BatchFile) -> None:
    """Delete the row, then the stored bytes (a failed storage delete leaves an orphan, never a row
    pointing at nothing)."""
    name = file.storage_name
    file.delete()
    transaction.on_commit(lambda: default_storage.delete(name))


def _metadata(metadata: object) -> dict | None:
    if metadata is None:
        return None
    if not isinstance(metadata, dict) or len(metadata) > METADATA_MAX_PAIRS:
        raise ApplicationError(
            f"metadata must be an object of at most {METADATA_MAX_PAIRS} string pairs.", field="metadata"
        )
    for key, value in metadata.items():
        if not isinstance(value, str) or len(key) > METADATA_KEY_MAX or len(value) > METADATA_VALUE_MAX:
            raise ApplicationError(
                f"metadata keys are at most {METADATA_KEY_MAX} characters and values strings of at most "
                f"{METADATA_VALUE_MAX}.",
                field="metadata",
            )
    return metadata


def batch_create(
    *,
    team: Team,
    api_key: ApiKey,
    input_file_id: str,
    endpoint: str,
    completion_window: str,
    metadata: object = None,
) -> Batch:
    """A batch in `validating`; its validation task is sent once the row is committed."""
    if endpoint not in BatchEndpoint.values:
        raise ApplicationError(
            f"endpoint must be one of {', '.join(BatchEndpoint.values)}, not `{str(endpoint)[:60]}`.",
            field="endpoint",
        )
    window = COMPLETION_WINDOWS.get(completion_window)
    if window is None:
        raise ApplicationError("completion_window must be `24h`.", field="completion_window")
    input_file = BatchFile.objects.filter(team=team, public_id=input_file_id).first()
    if input_file is None:
        raise ApplicationError(f"No such file: `{str(input_file_id)[:60]}`.", field="input_file_id")
    if input_file.purpose != FilePurpose.BATCH:
        raise ApplicationError("The input file's purpose must be `batch`.", field="input_file_id")
    now = timezone.now()
    batch = Batch.objects.create(
        team=team,
        api_key=api_key,
        input_file=input_file,
        input_file_public_id=input_file.public_id,
        endpoint=endpoint,
        completion_window=completion_window,
        metadata=_metadata(metadata),
        expires_at=now + window,
    )
    send_on_commit("batches.validate", batch.pk)
    return batch


def send_on_commit(task: str, batch_id: int, *, expires_s: float | None = None) -> None:
    """Send a batch task by name once the transaction commits (`expires_s`: a message no worker
    took by then is dropped; the dispatcher has sent a newer one)."""
    from portal.celery import app

    def send() -> None:
        if app.conf.task_always_eager:  # send_task ignores eager mode
            app.loader.import_default_modules()
            app.tasks[task].apply(args=(batch_id,))
        else:
            app.send_task(task, args=[batch_id], expires=expires_s)

    transaction.on_commit(send)


def batch_send_run(*, batch_id: int, expires_s: float | None = None) -> None:
    """Ask a batch worker to run (or resume) the batch; a duplicate is a no-op (its lease)."""
    send_on_commit("batches.run", batch_id, expires_s=expires_s)


def batch_cancel(*, batch: Batch) -> Batch:
    """Stop dispatching at once: `validating` or `in_progress` → `cancelling`. Lines in flight finish;
    the runner (or the dispatcher, when none runs) writes the partial files and ends `cancelled`."""
    now = timezone.now()
    moved = Batch.objects.filter(
        pk=batch.pk, status__in=[BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS]
    ).update(status=BatchStatus.CANCELLING, cancelling_at=now)
    batch.refresh_from_db()
    if not moved and batch.status not in (BatchStatus.CANCELLING, BatchStatus.CANCELLED):
        raise ApplicationError(f"A batch that is `{batch.status}` cannot be cancelled.", field="batch")
    if moved:
        batch_send_run(batch_id=batch.pk)
    return batch


def batch_move(*, batch_id: int, from_statuses: list[str], to: str, **fields) -> bool:
    """One claimed status change, with its timestamp (`<status>_at`); False if the batch was not in
    one of `from_statuses` (someone else moved it)."""
    stamp = f"{to}_at"
    if hasattr(Batch, stamp) and stamp not in fields:
        fields[stamp] = timezone.now()
    return Batch.objects.filter(pk=batch_id, status__in=from_statuses).update(status=to, **fields) == 1


def lines_create(*, batch: Batch, lines: list[tuple[int, str, dict]]) -> None:
    """Store the validated lines (line number, custom_id, body) in one go."""
    BatchLine.objects.bulk_create(
        [BatchLine(batch=batch, line_number=n, custom_id=c, body=b) for n, c, b in lines], batch_size=1000
    )


def jsonl(rows: list[dict]) -> bytes:
    return b"".join(json.dumps(row, separators=(",", ":")).encode() + b"\n" for row in rows)


def lines_cancel_pending(*, batch_id: int) -> int:
    """Lines never sent (a cancel, an expiry) are `cancelled`: they appear in no file."""
    return BatchLine.objects.filter(batch_id=batch_id, state=LineState.PENDING).update(
        state=LineState.CANCELLED, finished_at=timezone.now()
    )


# --- Staff's pause of all batch work ---------------------------------------------------------------


def batches_pause_set(*, paused: bool, by: str) -> None:
    """Pause (or resume) every batch: runners stop dispatching at their next tick (lines in flight
    finish) and leave; on resume the dispatcher starts them again."""
    from .models import BatchPause

    BatchPause.objects.update_or_create(
        pk=1, defaults={"paused": paused, "changed_at": timezone.now(), "changed_by": by[:150]}
    )


# --- Retention -------------------------------------------------------------------------------------


def batches_prune(*, now: dt.datetime, batch_size: int) -> int:
    """Delete files past their `expires_at` (row, then stored bytes), except the input of a batch
    still running, and the lines of batches whose files are all gone (their results live in the
    files until then). Returns how many files went."""
    from portal.core.services import delete_in_batches

    active_inputs = Batch.objects.exclude(status__in=TERMINAL_STATUSES).values("input_file_id")
    expired = BatchFile.objects.filter(expires_at__lt=now).exclude(pk__in=active_inputs)
    deleted = 0
    for file in expired.iterator(chunk_size=batch_size):
        file_delete(file=file)
        deleted += 1
    ended = Batch.objects.filter(
        status__in=TERMINAL_STATUSES, output_file__isnull=True, error_file__isnull=True
    )
    ended = ended.filter(
        created_at__lt=now - dt.timedelta(days=max(1, settings.BATCH_FILE_RETENTION_DAYS or 36_500))
    )
    delete_in_batches(BatchLine.objects.filter(batch__in=ended), batch_size=batch_size)
    return deleted
