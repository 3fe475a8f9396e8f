"""Claim, lease, fence: the one way a long job takes its row, keeps it and writes to it.

- `claim` is one conditional UPDATE: the row is claimable (the kind says when, e.g. `queued`) and
  its lease is free or lapsed; it bumps `lease_token` and sets the expiry. PostgreSQL re-checks the
  WHERE clause on a row a concurrent claimer just committed, so exactly one of two wins; a
  duplicate or redelivered message finds the lease live and gets None.
- `Lease.fenced()` is a transaction that first locks the row with our token (and the kind's `live`
  condition); a worker whose token is gone gets `LostLease` and writes nothing. Every write a job
  makes (its row, its events, its saved levels) goes through it; `write` is the one-row shortcut.
- Whoever ends a job under its holder (a sweep, a cancel, superseding) calls `lease_break`: the
  token moves on, so the stalled holder's next write is refused.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from celery import current_task
from django.db import DatabaseError, transaction
from django.db.models import F, Q, QuerySet
from django.utils import timezone

from .models import LeasedJob

logger = logging.getLogger(__name__)

# Called with the lease and the names of the fields about to be written (empty for a `fenced()`
# block) before every fenced write: where a test pauses a worker mid-job (waiting on an event) to
# stall it past its lease. Empty in production.
_before_write: list[Callable[[Lease, frozenset[str]], None]] = []


class LostLease(Exception):
    """Another worker holds the job now, or it was ended under us: this worker's writes are void."""


def worker_name(task_id: str | None = None) -> str:
    """Who holds a lease: host, process and Celery task (or thread), as `lease_owner` shows it."""
    if task_id is None and current_task:
        task_id = current_task.request.id
    return f"{socket.gethostname()}:{os.getpid()}:{task_id or threading.current_thread().name}"[:200]


def lease_free(now: datetime | None = None) -> Q:
    """No worker holds the row: never leased, released, or its lease lapsed."""
    return Q(lease_expires_at__isnull=True) | Q(lease_expires_at__lt=now or timezone.now())


def _stamped(model: type[LeasedJob], fields: dict, now: datetime) -> dict:
    # `update()` skips auto_now; a job's row still says when it last changed.
    if "updated_at" in {f.name for f in model._meta.concrete_fields}:
        fields.setdefault("updated_at", now)
    return fields


@dataclass
class Lease:
    """The right to write one job's rows while `token` is the row's `lease_token`."""

    model: type[LeasedJob]
    target_id: int
    token: int
    owner: str
    ttl_s: float
    # What the row must still say besides the token (e.g. `state=running`), as the kind's old fences did.
    live: Q = field(default_factory=Q)
    _inside: int = field(default=0, init=False, repr=False, compare=False)

    def _mine(self) -> QuerySet:
        return self.model._default_manager.filter(self.live, pk=self.target_id, lease_token=self.token)

    def _lost(self) -> LostLease:
        name = self.model._meta.label
        return LostLease(
            f"{name} {self.target_id}: lease {self.token} of {self.owner} was taken over or ended"
        )

    def _until(self, now: datetime) -> datetime:
        return now + timedelta(seconds=self.ttl_s)

    @contextlib.contextmanager
    def fenced(self) -> Iterator[LeasedJob]:
        """A transaction holding the job's row locked, entered only while the lease is ours.

        Everything written inside commits with the check or not at all; the row (locked, fresh) is
        yielded. Raises `LostLease` before any write when the token moved on.
        """
        if not self._inside:
            for hook in _before_write:
                hook(self, frozenset())
        with transaction.atomic():
            row = self._mine().select_for_update().first()
            if row is None:
                raise self._lost()
            self._inside += 1
            try:
                yield row
            finally:
                self._inside -= 1

    def write(self, **fields) -> None:
        """Update the job's row, renewing the lease, only while the lease is ours (else `LostLease`)."""
        if not self._inside:  # inside `fenced` the row is locked: never pause a worker there
            for hook in _before_write:
                hook(self, frozenset(fields))
        now = timezone.now()
        fields.setdefault("lease_expires_at", self._until(now))
        # One conditional UPDATE: it locks the row and checks the token in the same statement.
        if self._mine().update(**_stamped(self.model, fields, now)) != 1:
            raise self._lost()

    def renew(self) -> None:
        """Push the expiry on; a failed renewal is logged (and raised: the job must stop writing)."""
        try:
            self.write()
        except LostLease:
            logger.warning(
                "%s %s: renewal refused, lease %s lost", self.model._meta.label, self.target_id, self.token
            )
            raise
        except DatabaseError as error:
            logger.warning("%s %s: renewal failed: %s", self.model._meta.label, self.target_id, error)
            raise

    def finish(self, **fields) -> None:
        """The job's last write: its outcome, and the lease let go (the token stays, it only grows)."""
        self.write(lease_owner="", lease_expires_at=None, **fields)

    def release(self) -> bool:
        """Let the lease go if it is still ours; False (nothing written) when it is not."""
        now = timezone.now()
        return bool(
            self._mine().update(**_stamped(self.model, {"lease_owner": "", "lease_expires_at": None}, now))
        )


def claim(
    model: type[LeasedJob],
    target_id: int,
    *,
    worker: str,
    ttl_s: float,
    claimable: Q | None = None,
    live: Q | None = None,
    **on_claim,
) -> Lease | None:
    """Take the job if it is `claimable` and its lease is free or lapsed (bumping the token); else None.

    `on_claim` are the fields the claim also sets (e.g. `state=running`); `live` is what every
    fenced write checks besides the token.
    """
    if not worker:
        raise ValueError("a lease needs the name of the worker that holds it")
    now = timezone.now()
    fields = {
        "lease_token": F("lease_token") + 1,
        "lease_owner": worker[:200],
        "lease_expires_at": now + timedelta(seconds=ttl_s),
        **on_claim,
    }
    # Free: lapsed, never taken, or without a holder (a queued job's give-up deadline, a release).
    free = lease_free(now) | Q(lease_owner="")
    with transaction.atomic():
        claimed = model._default_manager.filter(claimable or Q(), free, pk=target_id).update(
            **_stamped(model, fields, now)
        )
        if claimed != 1:
            return None
        # Read inside the transaction: the token we just wrote, not a later claimer's.
        token = model._default_manager.values_list("lease_token", flat=True).get(pk=target_id)
    return Lease(model=model, target_id=target_id, token=token, owner=worker, ttl_s=ttl_s, live=live or Q())


def lease_break(queryset: QuerySet, **fields) -> int:
    """End jobs out from under whoever holds them: the token moves on, so a stalled holder's next
    write is refused; returns how many rows were changed."""
    now = timezone.now()
    return queryset.update(
        **_stamped(
            queryset.model,
            {"lease_token": F("lease_token") + 1, "lease_owner": "", "lease_expires_at": None, **fields},
            now,
        )
    )


@contextlib.contextmanager
def before_fenced_writes(hook: Callable[[Lease, frozenset[str]], None]) -> Iterator[None]:
    """Run `hook(lease, fields)` before every fenced write while inside (tests pause a worker here)."""
    _before_write.append(hook)
    try:
        yield
    finally:
        _before_write.remove(hook)
