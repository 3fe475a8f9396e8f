"""The API's objects, in OpenAI's shapes (https://platform.openai.com/docs/api-reference/batch/object
and /files/object): one function per object, read by the API and the pages alike."""

from __future__ import annotations

import datetime as dt

from .models import Batch, BatchFile


def _epoch(moment: dt.datetime | None) -> int | None:
    return int(moment.timestamp()) if moment is not None else None


def file_object(file: BatchFile) -> dict:
    return {
        "id": file.public_id,
        "object": "file",
        "bytes": file.bytes,
        "created_at": _epoch(file.created_at),
        "expires_at": _epoch(file.expires_at),
        "filename": file.filename,
        "purpose": file.purpose,
        "status": "processed",
        "status_details": None,
    }


def batch_object(batch: Batch) -> dict:
    return {
        "id": batch.public_id,
        "object": "batch",
        "endpoint": batch.endpoint,
        "errors": batch.errors,
        "input_file_id": batch.input_file_public_id,
        "completion_window": batch.completion_window,
        "status": batch.status,
        "output_file_id": batch.output_file.public_id if batch.output_file is not None else None,
        "error_file_id": batch.error_file.public_id if batch.error_file is not None else None,
        "created_at": _epoch(batch.created_at),
        "in_progress_at": _epoch(batch.in_progress_at),
        "expires_at": _epoch(batch.expires_at),
        "finalizing_at": _epoch(batch.finalizing_at),
        "completed_at": _epoch(batch.completed_at),
        "failed_at": _epoch(batch.failed_at),
        "expired_at": _epoch(batch.expired_at),
        "cancelling_at": _epoch(batch.cancelling_at),
        "cancelled_at": _epoch(batch.cancelled_at),
        "request_counts": {
            "total": batch.request_total,
            "completed": batch.request_completed,
            "failed": batch.request_failed,
        },
        "metadata": batch.metadata,
    }


def list_object(rows: list, *, shape, has_more: bool) -> dict:
    data = [shape(row) for row in rows]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": has_more,
    }
