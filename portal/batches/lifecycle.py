"""A batch's life outside its run: validation (`validating` → `in_progress` or `failed`), and the
dispatcher beat calls, which validates, starts, resumes and expires batches whose runner is not
alive (killed, or left to wait), so no batch depends on one task message arriving."""

from __future__ import annotations

import datetime as dt
import logging

from django.conf import settings
from django.db import transaction
from django.db.models import Q, QuerySet
from django.utils import timezone

from portal.core.jobs import Lease, lease_break, lease_free
from portal.gateway.internal import batch_caller_now

from . import services
from .models import Batch, BatchLine, BatchStatus, WaitReason
from .runner import RUNNABLE, lease_take
from .validation import validate_file

log = logging.getLogger("portal.batches")


def _validating(lease: Lease) -> QuerySet[Batch]:
    """The batch, only while this validation holds its lease and it is still `validating`."""
    return Batch.objects.filter(pk=lease.target_id, lease_token=lease.token, status=BatchStatus.VALIDATING)


def _fail(lease: Lease, errors: list[dict]) -> None:
    _validating(lease).update(
        status=BatchStatus.FAILED, failed_at=timezone.now(), errors={"object": "list", "data": errors}
    )


def batch_validate(*, batch_id: int) -> str:
    """Check every line of the batch's input file; store the lines and start it, or fail it with
    each bad line in `errors`. A no-op when another worker is validating it."""
    lease = lease_take(batch_id=batch_id, statuses=[BatchStatus.VALIDATING])
    if lease is None:
        return "not validating here"
    try:
        batch = Batch.objects.select_related("input_file").get(pk=batch_id)
        caller = batch_caller_now(batch.api_key_id) if batch.api_key_id else None
        if caller is None:
            _fail(lease, [_error("api_key_deleted", "The API key that created this batch was deleted.")])
            return "failed"
        if batch.input_file is None:
            _fail(lease, [_error("input_file_deleted", "The input file was deleted.")])
            return "failed"
        checked = validate_file(
            services.file_read(file=batch.input_file), endpoint=batch.endpoint, caller=caller
        )
        if checked.errors:
            _fail(lease, checked.errors)
            return "failed"
        with transaction.atomic():
            BatchLine.objects.filter(batch_id=batch_id).delete()  # a validation killed half way
            services.lines_create(batch=batch, lines=checked.lines)
            started = _validating(lease).update(
                status=BatchStatus.IN_PROGRESS,
                in_progress_at=timezone.now(),
                request_total=len(checked.lines),
            )
            if not started:  # cancelled meanwhile: the lines go with the rollback
                transaction.set_rollback(True)
                return "cancelled while validating"
            # Let go in the same commit that sends the run (on commit): a runner that takes the
            # message at once finds the lease free, not held by this validation until `finally`.
            lease.release()
            services.batch_send_run(batch_id=batch_id)
        return "in_progress"
    finally:
        lease.release()


def _error(code: str, message: str) -> dict:
    return {"code": code, "message": message, "param": None, "line": None}


def dispatch_grace_s() -> float:
    """How long a message the dispatcher sent may wait for a worker before it sends another: so a
    batch waiting behind busy workers gets one message a minute, not one per beat."""
    return max(60.0, 3 * settings.BATCH_DISPATCH_INTERVAL_S)


def batches_dispatch() -> dict[str, int]:
    """Send a validation or a run for every batch that needs one and has no live runner: new ones,
    those whose runner died (its lease lapsed), those waiting (paused, outside their window, past
    their daily budget's reset) and those past their window (the runner expires them). Each send
    marks the batch (a lease expiry without an owner) for `dispatch_grace_s`: a runner takes it at
    once, the dispatcher leaves it alone until then."""
    now = timezone.now()
    grace = dispatch_grace_s()
    idle = lease_free(now)  # no expiry, or a lapsed one: nobody holds it and no send is pending
    budget_waits = Q(wait_reason=WaitReason.DAILY_BUDGET, wait_until__gt=now, expires_at__gt=now)
    sent = {"validate": 0, "run": 0}
    candidates = Batch.objects.filter(idle, status__in=[BatchStatus.VALIDATING, *RUNNABLE]).exclude(
        budget_waits
    )
    for batch_id, status in candidates.values_list("pk", "status"):
        # The mark breaks the lapsed lease (the token moves on, as clearing the old `runner_token`
        # did, so a stalled runner's next renewal is refused) and sets an expiry with no owner:
        # `claim` takes an ownerless lease at once, while `idle` above leaves it alone until then.
        marked = lease_break(
            Batch.objects.filter(idle, pk=batch_id), lease_expires_at=now + dt.timedelta(seconds=grace)
        )
        if not marked:  # a runner took it meanwhile
            continue
        task = "validate" if status == BatchStatus.VALIDATING else "run"
        services.send_on_commit(f"batches.{task}", batch_id, expires_s=grace)
        sent[task] += 1
    return sent
