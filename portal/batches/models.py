"""Batch jobs in the shape of OpenAI's Batch API: uploaded files, batches, and one row per line.

A batch's progress is stored line by line (`BatchLine`), so a runner that dies resumes where the
rows say, and the output file is built from the rows once every line is done (docs/batches.md).
Files live in Django's storage (`default_storage`) under a per-team prefix; the rows hold their
metadata and where they are stored.
"""

from __future__ import annotations

import secrets
import uuid

from django.db import models

from portal.core.jobs.models import LeasedJob


def new_file_id() -> str:
    return f"file-{secrets.token_hex(12)}"


def new_batch_id() -> str:
    return f"batch_{secrets.token_hex(12)}"


class FilePurpose(models.TextChoices):
    BATCH = "batch", "batch input"
    BATCH_OUTPUT = "batch_output", "batch output"


class BatchFile(models.Model):
    """A file a team uploaded (`purpose=batch`) or the portal wrote (a batch's output or errors)."""

    public_id = models.CharField(max_length=40, unique=True, default=new_file_id, editable=False)
    team = models.ForeignKey("teams.Team", on_delete=models.CASCADE, related_name="batch_files")
    purpose = models.CharField(max_length=20, choices=FilePurpose.choices)
    filename = models.CharField(max_length=255)
    bytes = models.PositiveBigIntegerField()
    # Where default_storage holds it: `batches/<team id>/<public id>`.
    storage_name = models.CharField(max_length=500)
    created_at = models.DateTimeField(auto_now_add=True)
    # After this the daily prune deletes it (BATCH_FILE_RETENTION_DAYS; null: kept).
    expires_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [models.Index(fields=["team", "-created_at"])]

    def __str__(self) -> str:
        return self.public_id


class BatchEndpoint(models.TextChoices):
    CHAT = "/v1/chat/completions", "/v1/chat/completions"
    COMPLETIONS = "/v1/completions", "/v1/completions"


class BatchStatus(models.TextChoices):
    """OpenAI's statuses (https://platform.openai.com/docs/api-reference/batch/object)."""

    VALIDATING = "validating", "validating"
    FAILED = "failed", "failed"
    IN_PROGRESS = "in_progress", "in progress"
    FINALIZING = "finalizing", "finalizing"
    COMPLETED = "completed", "completed"
    EXPIRED = "expired", "expired"
    CANCELLING = "cancelling", "cancelling"
    CANCELLED = "cancelled", "cancelled"


# Statuses a batch never leaves.
TERMINAL_STATUSES = frozenset(
    {BatchStatus.FAILED, BatchStatus.COMPLETED, BatchStatus.EXPIRED, BatchStatus.CANCELLED}
)


class WaitReason(models.TextChoices):
    """Why an in-progress batch is not dispatching now (shown on its page)."""

    NONE = "", "running"
    PAUSED = "paused", "staff paused all batch work"
    RUN_WINDOW = "run_window", "outside the run window"
    DAILY_BUDGET = "daily_budget", "the team's daily token budget is spent"
    NO_REPLICA = "no_replica", "no replica serves the model"


class Batch(LeasedJob):
    public_id = models.CharField(max_length=40, unique=True, default=new_batch_id, editable=False)
    team = models.ForeignKey("teams.Team", on_delete=models.CASCADE, related_name="batches")
    # The key that created it: its lines run as requests of this key (quotas, class, models).
    api_key = models.ForeignKey("teams.ApiKey", null=True, on_delete=models.SET_NULL, related_name="batches")
    input_file = models.ForeignKey(BatchFile, null=True, on_delete=models.SET_NULL, related_name="+")
    input_file_public_id = models.CharField(max_length=40)  # kept after the file is deleted
    endpoint = models.CharField(max_length=30, choices=BatchEndpoint.choices)
    completion_window = models.CharField(max_length=10, default="24h")
    metadata = models.JSONField(null=True, blank=True)
    status = models.CharField(
        max_length=20, choices=BatchStatus.choices, default=BatchStatus.VALIDATING, db_index=True
    )
    request_total = models.PositiveIntegerField(default=0)
    request_completed = models.PositiveIntegerField(default=0)
    request_failed = models.PositiveIntegerField(default=0)
    # OpenAI's `errors`: {"object": "list", "data": [{"code", "message", "param", "line"}]} or null.
    errors = models.JSONField(null=True, blank=True)
    output_file = models.ForeignKey(
        BatchFile, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    error_file = models.ForeignKey(
        BatchFile, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    in_progress_at = models.DateTimeField(null=True, blank=True)
    expires_at = models.DateTimeField()  # created_at + completion_window
    finalizing_at = models.DateTimeField(null=True, blank=True)
    completed_at = models.DateTimeField(null=True, blank=True)
    failed_at = models.DateTimeField(null=True, blank=True)
    expired_at = models.DateTimeField(null=True, blank=True)
    cancelling_at = models.DateTimeField(null=True, blank=True)
    cancelled_at = models.DateTimeField(null=True, blank=True)
    # Why it waits (run window, pause, daily budget) and until when, for the batch page.
    wait_reason = models.CharField(max_length=20, choices=WaitReason.choices, blank=True, default="")
    wait_until = models.DateTimeField(null=True, blank=True)
    # The runner's lease (LeasedJob: portal/core/jobs, docs/jobs.md): one runner (or validation) at
    # a time; a lapsed lease is taken over with the next fencing token.

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [models.Index(fields=["team", "-created_at"])]
        verbose_name_plural = "batches"

    def __str__(self) -> str:
        return self.public_id


class LineState(models.TextChoices):
    PENDING = "pending", "pending"
    RUNNING = "running", "running"
    SUCCEEDED = "succeeded", "succeeded"  # an answer (any HTTP status) is stored
    FAILED = "failed", "failed"  # no answer: the error is stored
    CANCELLED = "cancelled", "cancelled"  # never sent (the batch was cancelled or expired)


DONE_LINE_STATES = frozenset({LineState.SUCCEEDED, LineState.FAILED, LineState.CANCELLED})


class BatchLine(models.Model):
    """One request of a batch: what to send, and once it ran, what came back."""

    batch = models.ForeignKey(Batch, on_delete=models.CASCADE, related_name="lines")
    line_number = models.PositiveIntegerField()  # 1-based, as OpenAI's errors count lines
    custom_id = models.CharField(max_length=512)
    # The line's id: the gateway request id of its one attempt that counts, and its usage row's
    # request_id (the idempotency key: a line is billed and written out once).
    request_id = models.UUIDField(default=uuid.uuid4, unique=True, editable=False)
    body = models.JSONField()
    state = models.CharField(max_length=12, choices=LineState.choices, default=LineState.PENDING)
    attempts = models.PositiveSmallIntegerField(default=0)
    # The lease token of the runner that claimed it: set with state=running; the next runner to take
    # the batch puts its predecessor's running lines back to pending.
    claim_token = models.BigIntegerField(null=True, blank=True)
    response_status = models.PositiveSmallIntegerField(null=True, blank=True)
    response_body = models.JSONField(null=True, blank=True)
    error = models.JSONField(null=True, blank=True)  # {"code", "message"} when no answer came
    prompt_tokens = models.PositiveIntegerField(default=0)
    completion_tokens = models.PositiveIntegerField(default=0)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["batch", "line_number"]
        constraints = [
            models.UniqueConstraint(fields=["batch", "line_number"], name="batch_line_number_once"),
            models.UniqueConstraint(fields=["batch", "custom_id"], name="batch_custom_id_once"),
        ]
        indexes = [models.Index(fields=["batch", "state"])]

    def __str__(self) -> str:
        return f"{self.batch_id}:{self.line_number}"


class BatchPause(models.Model):
    """Staff's switch for all batch work (one row, pk 1): while paused, no line is dispatched;
    lines in flight finish. In the database, so a Redis restart cannot lift a pause."""

    paused = models.BooleanField(default=False)
    changed_at = models.DateTimeField(null=True, blank=True)
    changed_by = models.CharField(max_length=150, blank=True)  # a username or "manage.py batches"

    def __str__(self) -> str:
        return "paused" if self.paused else "running"
