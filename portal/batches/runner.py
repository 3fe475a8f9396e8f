"""The batch runner: one per batch at a time (a lease on the batch row), sending its lines through
the gateway's own pipeline as requests of the batch's key in the batch class
(`portal.gateway.internal.forward`), with bounded concurrency, storing each result as it comes.

The lease is portal/core/jobs' (`Batch` is a `LeasedJob`, docs/jobs.md): `claim` takes the batch
with the next fencing token, every tick renews it, and the runner's writes to the batch row are
fenced by it. Exactly once (docs/batches.md): a line is claimed (`state=running`, `claim_token` =
the runner's lease token); its result, its usage row (request_id = the line's id, source `batch`)
and the batch's counts are written in one transaction that first moves the line `running → done`
under that token, checking the row count. A runner that lost its lease (killed, or too slow to
renew) can no longer store anything: the runner that took over put its lines back to pending. The
output and error files are built from the rows, once every line is done.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.db import close_old_connections, connections, transaction
from django.db.models import F, Q
from django.utils import timezone

from portal.core.jobs import Lease, LostLease, claim, worker_name
from portal.gateway.internal import Caller, Forwarded, batch_caller, forward
from portal.teams.models import UsageSource
from portal.teams.services.usage_queue import usage_row

from . import selectors, services
from .models import (
    Batch,
    BatchEndpoint,
    BatchLine,
    BatchPause,
    BatchStatus,
    FilePurpose,
    LineState,
    WaitReason,
)
from .windows import next_window_start, within_window

log = logging.getLogger("portal.batches")

# How long a runner holds the batch while it writes the output and error files.
FINALIZE_LEASE = dt.timedelta(minutes=10)
# Upstream failures of one line before it is failed for good (a refusal for room never counts).
LINE_MAX_ATTEMPTS = 3
# The gateway's answers that mean "not now": the line goes back to pending, and is sent again later.
NOT_NOW = frozenset(
    {
        "rate_limit_exceeded",
        "queue_full",
        "queue_timeout",
        "batch_queue_full",
        "batch_queue_timeout",
        "no_replica",
        "rate_limiter_unavailable",
        "database_unavailable",
        "client_disconnected",
    }
)
# ... and those that mean "not today": the team's (or key's) daily token budget is spent.
NOT_TODAY = frozenset({"tokens_per_day_exceeded", "daily_budget_exceeded", "key_disabled"})
# An upstream failure: tried again, up to LINE_MAX_ATTEMPTS.
UPSTREAM_FAILURES = frozenset(
    {"upstream_error", "upstream_unreachable", "upstream_timeout", "internal_error"}
)


def _db(func, *args, **kwargs):
    """Run a database function off the event loop."""
    from asgiref.sync import sync_to_async

    def call():
        close_old_connections()
        return func(*args, **kwargs)

    return sync_to_async(call)()


# --- The lease -----------------------------------------------------------------------------------


def lease_take(*, batch_id: int, statuses: Sequence[str]) -> Lease | None:
    """Take the batch for this worker if it is in one of `statuses` and no live runner holds it (the
    next fencing token); then its lines left `running` by the runner before (dead, or one that lost
    its lease) are pending again. None when it is held or not in those statuses."""
    lease = claim(
        Batch,
        batch_id,
        worker=worker_name(),
        ttl_s=settings.BATCH_RUNNER_LEASE_S,
        claimable=Q(status__in=statuses),
    )
    if lease is not None:
        BatchLine.objects.filter(batch_id=batch_id, state=LineState.RUNNING).update(
            state=LineState.PENDING, claim_token=None
        )
    return lease


def _write(lease: Lease, **fields: Any) -> bool:
    """Write the batch row (renewing the lease) if the lease is still ours; False (nothing written)
    when another runner took over or the batch was ended under us."""
    try:
        lease.write(**fields)
    except LostLease:
        return False
    return True


# --- What the runner may do now --------------------------------------------------------------------


@dataclass(frozen=True)
class Tick:
    lost: bool = False  # another runner holds the batch, or it ended
    end: str = ""  # "cancelled", "expired" or "finalizing": stop dispatching, finish with what completed
    wait: str = ""  # a WaitReason: stop dispatching, leave once the lines in flight are done
    wait_until: dt.datetime | None = None


def _tick(lease: Lease) -> Tick:
    """Renew the lease and read what the runner may do: dispatch, wait, or end the batch."""
    try:
        lease.renew()
    except LostLease:
        return Tick(lost=True)
    now = timezone.now()
    batch = Batch.objects.select_related("team").get(pk=lease.target_id)
    if batch.status == BatchStatus.CANCELLING:
        return Tick(end="cancelled")
    if batch.status == BatchStatus.FINALIZING:  # a runner died while writing the files: write them again
        return Tick(end="finalizing")
    if batch.status != BatchStatus.IN_PROGRESS:
        return Tick(lost=True)
    if now >= batch.expires_at:
        return Tick(end="expired")
    if BatchPause.objects.filter(pk=1, paused=True).exists():
        return Tick(wait=WaitReason.PAUSED)
    window = batch.team.batch_run_window or settings.BATCH_RUN_WINDOW
    if window and not within_window(window, now):
        return Tick(wait=WaitReason.RUN_WINDOW, wait_until=next_window_start(window, now))
    if batch.wait_reason == WaitReason.DAILY_BUDGET and batch.wait_until and now < batch.wait_until:
        return Tick(wait=WaitReason.DAILY_BUDGET, wait_until=batch.wait_until)
    return Tick()


def _set_wait(lease: Lease, reason: str, until: dt.datetime | None) -> None:
    _write(lease, wait_reason=reason, wait_until=until)


def _claim(batch_id: int, token: int, count: int) -> list[BatchLine]:
    """Claim up to `count` pending lines, lowest line numbers first (a conditional update: a line
    another runner holds is never taken)."""
    with transaction.atomic():
        ids = list(
            BatchLine.objects.select_for_update(skip_locked=True)
            .filter(batch_id=batch_id, state=LineState.PENDING)
            .order_by("line_number")
            .values_list("pk", flat=True)[:count]
        )
        if not ids:
            return []
        BatchLine.objects.filter(pk__in=ids, state=LineState.PENDING).update(
            state=LineState.RUNNING, claim_token=token, attempts=F("attempts") + 1
        )
    return list(BatchLine.objects.filter(pk__in=ids, claim_token=token).order_by("line_number"))


def _release(line_id: int, token: int, *, undo_attempt: bool) -> None:
    """A line that did not run (no room, not today) is pending again, its attempt not counted."""
    fields: dict[str, Any] = {"state": LineState.PENDING, "claim_token": None}
    if undo_attempt:
        fields["attempts"] = F("attempts") - 1
    BatchLine.objects.filter(pk=line_id, state=LineState.RUNNING, claim_token=token).update(**fields)


def _store(batch: Batch, line: BatchLine, token: int, result: Forwarded | None, error: dict | None) -> bool:
    """The line's one result, its one usage row and the batch's count, in one transaction; False
    (nothing written) if the line is no longer this runner's."""
    succeeded = result is not None and result.status == 200
    now = timezone.now()
    fields: dict[str, Any] = {
        "state": LineState.SUCCEEDED if succeeded else LineState.FAILED,
        "claim_token": None,
        "finished_at": now,
        "error": error,
    }
    if result is not None:
        fields.update(
            response_status=result.status,
            response_body=result.body,
            prompt_tokens=result.usage.prompt_tokens,
            completion_tokens=result.usage.completion_tokens,
        )
    with transaction.atomic():
        if not BatchLine.objects.filter(pk=line.pk, state=LineState.RUNNING, claim_token=token).update(
            **fields
        ):
            return False
        if result is not None:
            record = result.usage
            row = usage_row(record, source=UsageSource.BATCH, batch_id=batch.public_id)
            row.request_id = line.request_id  # the line's id: one row per line, whatever the attempts
            row.save(force_insert=True)
        counter = "request_completed" if succeeded else "request_failed"
        Batch.objects.filter(pk=batch.pk).update(**{counter: F(counter) + 1})
    return True


# --- The run ---------------------------------------------------------------------------------------


class Runner:
    def __init__(self, batch: Batch, lease: Lease) -> None:
        self.batch = batch
        self.lease = lease
        self.token = lease.token  # what this runner's line claims carry
        self.chat = batch.endpoint == BatchEndpoint.CHAT
        self.caller: Caller | None = None
        self.retry_at = 0.0  # loop time before which no line is sent (the gateway said "not now")
        self.budget_until: dt.datetime | None = None  # the gateway said "not today"

    async def run(self) -> str:
        loop = asyncio.get_running_loop()
        loaded_at = -float("inf")
        inflight: set[asyncio.Task] = set()
        pause_s = settings.BATCH_RUNNER_LEASE_S / 3
        while True:
            tick = await _db(_tick, self.lease)
            if loop.time() - loaded_at >= settings.GATEWAY_CACHE_S and self.batch.api_key_id is not None:
                # The key's quotas, clamp and models as the gateway sees them: reloaded as often as its cache.
                self.caller = await batch_caller(self.batch.api_key_id)
                loaded_at = loop.time()
            if tick.lost:
                await self._drain(inflight)
                return "lost the lease"
            if self.budget_until is not None and not tick.end:
                tick = Tick(wait=WaitReason.DAILY_BUDGET, wait_until=self.budget_until)
            dispatching = not tick.end and not tick.wait
            if dispatching and self.batch.wait_reason:
                await _db(_set_wait, self.lease, "", None)
                self.batch.wait_reason = ""
            if dispatching and loop.time() >= self.retry_at:
                free = settings.BATCH_CONCURRENCY - len(inflight)
                claimed = await _db(_claim, self.batch.pk, self.token, free) if free > 0 else []
                for line in claimed:
                    inflight.add(asyncio.create_task(self._line(line)))
                if not inflight and not claimed:
                    await _db(finish, lease=self.lease, end="")
                    return "completed"
            if not inflight:
                if tick.end:
                    end = "" if tick.end == "finalizing" else tick.end
                    await _db(finish, lease=self.lease, end=end)
                    return tick.end
                if tick.wait:
                    await _db(_set_wait, self.lease, tick.wait, tick.wait_until)
                    return f"waiting: {tick.wait}"
                await asyncio.sleep(min(pause_s, max(0.0, self.retry_at - loop.time())))
                continue
            done, _ = await asyncio.wait(inflight, timeout=pause_s, return_when=asyncio.FIRST_COMPLETED)
            inflight -= done

    async def _drain(self, inflight: set[asyncio.Task]) -> None:
        if inflight:
            await asyncio.wait(inflight)

    async def _line(self, line: BatchLine) -> None:
        try:
            await self._send(line)
        except Exception:
            # A fault of the portal's own (the database gone a moment): the line is tried again later.
            log.exception(
                "batch %s line %s: not stored; it will be sent again", self.batch.public_id, line.line_number
            )
            self.retry_at = max(self.retry_at, asyncio.get_running_loop().time() + settings.BATCH_RETRY_S)
            try:
                await _db(_release, line.pk, self.token, undo_attempt=True)
            except Exception:
                log.exception("batch %s line %s: not released", self.batch.public_id, line.line_number)

    async def _send(self, line: BatchLine) -> None:
        if self.caller is None:
            error = {"code": "api_key_deleted", "message": "The API key that created this batch was deleted."}
            await _db(_store, self.batch, line, self.token, None, error)
            return
        body = json.dumps(line.body, separators=(",", ":")).encode()
        result = await forward(self.caller, body, chat=self.chat, request_id=line.request_id.hex)
        code = result.error_code
        if result.status != 200 and code in NOT_NOW:
            wait = max(settings.BATCH_RETRY_S, result.retry_after_s or 0.0)
            self.retry_at = max(self.retry_at, asyncio.get_running_loop().time() + wait)
            await _db(_release, line.pk, self.token, undo_attempt=True)
            return
        if result.status != 200 and code in NOT_TODAY:
            self.budget_until = _next_utc_midnight(timezone.now())
            await _db(_release, line.pk, self.token, undo_attempt=True)
            return
        if result.status >= 500 and code in UPSTREAM_FAILURES and line.attempts < LINE_MAX_ATTEMPTS:
            self.retry_at = max(self.retry_at, asyncio.get_running_loop().time() + settings.BATCH_RETRY_S)
            await _db(_release, line.pk, self.token, undo_attempt=False)
            return
        await _db(_store, self.batch, line, self.token, result, None)


def _next_utc_midnight(now: dt.datetime) -> dt.datetime:
    """When daily token budgets reset (the gateway's days are UTC days)."""
    return (now.astimezone(dt.UTC) + dt.timedelta(days=1)).replace(hour=0, minute=0, second=0, microsecond=0)


# --- The end: files from the rows ------------------------------------------------------------------


def _output_line(line: BatchLine) -> dict:
    response = None
    if line.response_status is not None:
        response = {
            "status_code": line.response_status,
            "request_id": line.request_id.hex,
            "body": line.response_body,
        }
    return {
        "id": f"batch_req_{line.request_id.hex}",
        "custom_id": line.custom_id,
        "response": response,
        "error": line.error,
    }


def finish(*, lease: Lease, end: str) -> bool:
    """End a batch whose lines are all done (`end` ""), or that was cancelled or expired: lines not
    sent are `cancelled` (a cancel) or failed as `batch_expired` (an expiry, as OpenAI reports them);
    the output file (answers with status 200) and the error file (the rest) are built from the rows in
    line order; then the batch ends, under this runner's lease. False if the lease was lost."""
    batch_id = lease.target_id
    now = timezone.now()
    # Building the files of a large batch can outlast a lease: hold the batch long enough for it.
    if not _write(lease, lease_expires_at=now + FINALIZE_LEASE):
        return False
    if end == "":
        services.batch_move(
            batch_id=batch_id, from_statuses=[BatchStatus.IN_PROGRESS], to=BatchStatus.FINALIZING
        )
        if not Batch.objects.filter(pk=batch_id, status=BatchStatus.FINALIZING).exists():
            return False  # cancelled or expired meanwhile: the next run ends it that way
    elif end == "cancelled":
        services.lines_cancel_pending(batch_id=batch_id)
    else:
        BatchLine.objects.filter(batch_id=batch_id, state=LineState.PENDING).update(
            state=LineState.FAILED,
            finished_at=now,
            error={
                "code": "batch_expired",
                "message": "This request could not be executed before the completion window expired.",
            },
        )
    batch = Batch.objects.select_related("team").get(pk=batch_id)
    outputs: list[dict[str, Any]] = []
    errors: list[dict[str, Any]] = []
    for line in selectors.batch_lines_done(batch_id=batch_id).iterator(chunk_size=1000):
        (outputs if line.response_status == 200 else errors).append(_output_line(line))
    files = {}
    for name, rows in (("output_file", outputs), ("error_file", errors)):
        if rows:
            files[name] = services.file_create(
                team=batch.team,
                filename=f"{batch.public_id}_{name.split('_')[0]}.jsonl",
                content=services.jsonl(rows),
                purpose=FilePurpose.BATCH_OUTPUT,
            )
    counts = selectors.batch_line_counts(batch_id=batch_id)
    final = {"": BatchStatus.COMPLETED, "cancelled": BatchStatus.CANCELLED, "expired": BatchStatus.EXPIRED}[
        end
    ]
    moved = Batch.objects.filter(
        pk=batch_id,
        lease_token=lease.token,
        status__in=[BatchStatus.FINALIZING, BatchStatus.CANCELLING, BatchStatus.IN_PROGRESS],
    ).update(
        status=final,
        **{f"{final}_at": now},
        output_file=files.get("output_file"),
        error_file=files.get("error_file"),
        request_completed=counts.succeeded,
        request_failed=counts.failed,
        wait_reason="",
        wait_until=None,
    )
    if not moved:  # another runner took over meanwhile: it writes the files
        for file in files.values():
            services.file_delete(file=file)
    return bool(moved)


# --- Entry points (tasks) --------------------------------------------------------------------------

_loop: asyncio.AbstractEventLoop | None = None
# The statuses a runner takes a batch in (FINALIZING: one whose runner died writing its files).
RUNNABLE = [BatchStatus.IN_PROGRESS, BatchStatus.CANCELLING, BatchStatus.FINALIZING]


def _event_loop() -> asyncio.AbstractEventLoop:
    """One event loop per worker process, reused by every run: the gateway keeps its Redis clients
    per loop (a loop per run would leave one behind each time)."""
    global _loop
    if _loop is None or _loop.is_closed():
        _loop = asyncio.new_event_loop()
    return _loop


def batch_run(*, batch_id: int) -> str:
    """Run (or resume) a batch in this process; a no-op if a live runner holds it."""
    lease = lease_take(batch_id=batch_id, statuses=RUNNABLE)
    if lease is None:
        return "not runnable here (held by a live runner, or not in progress)"
    loop = _event_loop()
    try:
        batch = Batch.objects.get(pk=batch_id)
        return loop.run_until_complete(Runner(batch, lease).run())
    finally:
        lease.release()
        # The database thread's connection is not kept between runs (hours may pass).
        loop.run_until_complete(_db(connections.close_all))
