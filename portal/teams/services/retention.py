"""Retention of the usage records: the day partitions kept ahead, and the prune of old days.

The DDL itself is `portal/teams/partitions.py`; this module decides what to create and drop
and when. A day is rolled up and closed before its records go (`services/rollups.py`).
"""

from __future__ import annotations

import datetime as dt
import logging
import time

from django.conf import settings
from django.db import transaction
from django.db.models import Sum
from django.utils import timezone

from .. import partitions
from ..models import Usage, UsageDaily
from .rollups import day_start, usage_rollup

log = logging.getLogger("portal.teams")


def usage_partitions_maintain(*, today: dt.date | None = None) -> list[dt.date]:
    """PostgreSQL: give each day from yesterday to USAGE_PARTITIONS_AHEAD_DAYS ahead its own
    partition, and move the rows that landed in the DEFAULT partition (a day without one) into
    their day's, if that day is still kept. Returns the days given a partition. No-op on SQLite."""
    if not partitions.usage_is_partitioned():
        return []
    today = today or timezone.now().astimezone(dt.UTC).date()
    wanted = {today + dt.timedelta(days=n) for n in range(-1, settings.USAGE_PARTITIONS_AHEAD_DAYS + 1)}
    keep_from = _retention_start(today)
    wanted |= {day for day in partitions.default_partition_days() if keep_from is None or day >= keep_from}
    created = [day for day in sorted(wanted) if partitions.partition_create(day)]
    if created:
        log.info("usage partitions created: %s", ", ".join(map(str, created)))
    return created


def _retention_start(today: dt.date) -> dt.date | None:
    """The first UTC day whose usage records retention keeps (None: kept forever)."""
    days = settings.RETENTION_USAGE_DAYS
    return today - dt.timedelta(days=days) if days else None


def _usage_close_day(day: dt.date) -> int:
    """Roll `day` up from its records and mark it closed (never recomputed again): the step before
    its records go. Returns how many records it had."""
    usage_rollup(day=day)
    UsageDaily.objects.filter(day=day).update(closed=True)
    return UsageDaily.objects.filter(day=day).aggregate(n=Sum("requests"))["n"] or 0


# How long one attempt to drop a partition may wait for its lock (each attempt is that long a
# pause for the usage flush at most), and how long the attempts go on before the prune gives up.
PARTITION_DROP_LOCK_WAIT_S = 0.2
PARTITION_DROP_PATIENCE_S = 300.0


def _usage_partition_drop_patiently(day: dt.date) -> bool:
    """Drop `day`'s partition in short attempts, backing off between them so the flush's inserts
    that queued behind an attempt go through; False if no attempt got the lock in time."""
    deadline = time.monotonic() + PARTITION_DROP_PATIENCE_S
    pause = 0.5
    while True:
        if partitions.partition_drop(day, lock_timeout_s=PARTITION_DROP_LOCK_WAIT_S):
            return True
        if time.monotonic() + pause > deadline:
            return False
        time.sleep(pause)
        pause = min(pause * 2, 10.0)


def usage_prune(*, before: dt.date, batch_size: int) -> int:
    """Remove the usage records of every UTC day before `before`, oldest day first; returns how many.

    Each day is rolled up (hourly and daily) and marked closed before its records go, so its rollups
    are complete and no later rollup recomputes them from what a half-done prune left. On
    PostgreSQL a day with its own partition goes with it, in the same transaction as its rollup
    (DROP TABLE: no row-by-row delete, no dead tuples, no vacuum); what is left, rows of the
    DEFAULT partition and every row on SQLite, is deleted in batches of `batch_size`.
    """
    from portal.core.services import delete_in_batches

    deleted = 0
    if partitions.usage_is_partitioned():
        for day in partitions.usage_partitions():
            if day >= before:
                break
            # Closed first, in a transaction of its own: a record of the day that arrives from now
            # on is dead-lettered, and a drop that does not get its lock now is tried again (this
            # run or the next) with the day's rollups already final.
            with transaction.atomic():
                records = _usage_close_day(day)
            if not _usage_partition_drop_patiently(day):
                log.warning("usage partition of %s not dropped: its table stayed locked; next run", day)
                break
            deleted += records
            log.info("usage partition of %s dropped", day)
    cutoff = day_start(before)
    while True:
        oldest = (
            Usage.objects.filter(created_at__lt=cutoff)
            .order_by("created_at")
            .values_list("created_at", flat=True)
            .first()
        )
        if oldest is None:
            return deleted
        day = oldest.astimezone(dt.UTC).date()
        with transaction.atomic():
            _usage_close_day(day)
        start = day_start(day)
        day_rows = Usage.objects.filter(created_at__gte=start, created_at__lt=start + dt.timedelta(days=1))
        deleted += delete_in_batches(day_rows, batch_size=batch_size)
