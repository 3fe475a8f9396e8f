"""Batch tasks: they take ids and call a service; a duplicate is a no-op (the batch's lease)."""

from __future__ import annotations

from celery import shared_task

from portal.core.tasking import skip_missing_row


@shared_task(name="batches.validate", ignore_result=True)
@skip_missing_row("batches.Batch", arg="batch_id")
def validate(batch_id: int) -> str:
    from .lifecycle import batch_validate

    return batch_validate(batch_id=batch_id)


@shared_task(name="batches.run", ignore_result=True)
@skip_missing_row("batches.Batch", arg="batch_id")
def run(batch_id: int) -> str:
    from .runner import batch_run

    return batch_run(batch_id=batch_id)


@shared_task(name="batches.dispatch", ignore_result=True)
def dispatch() -> dict:
    from .lifecycle import batches_dispatch

    return batches_dispatch()
