"""Usage rollups: the hourly rows recomputed from the records, the daily rows from the hours.

Pages read these rows, never the records (`portal/teams/selectors.py`). A closed day (its
records dropped by retention, `services/retention.py`) keeps its rows as they are.
"""

from __future__ import annotations

import contextlib
import datetime as dt

import redis
from django.db import transaction
from django.db.models import Count, Q, Sum
from django.db.models.functions import TruncHour

from portal.core.redis.client import gateway_redis, redis_keys

# BILLED: a refused or unavailable request ran nowhere, so the rollups' tokens leave its prompt out
# (`budgets_enforce` reads these sums: 225,012 refused prompt tokens once disabled a team for the day).
from ..models import BILLED, Usage, UsageDaily, UsageHourly, UsageStatus


def day_start(day: dt.date) -> dt.datetime:
    return dt.datetime.combine(day, dt.time.min, tzinfo=dt.UTC)


def closed_days(days: set[dt.date]) -> set[dt.date]:
    return set(UsageDaily.objects.filter(day__in=days, closed=True).values_list("day", flat=True))


def usage_rollup_hours(*, since: dt.datetime, until: dt.datetime) -> int:
    """Recompute the hourly rows of every UTC hour in [since, until) (whole hours) from the usage
    records, in one query; returns how many rows. Idempotent. Hours of a closed day (its records
    dropped by retention) keep their rows as they are."""
    since = since.astimezone(dt.UTC).replace(minute=0, second=0, microsecond=0)
    until = until.astimezone(dt.UTC)
    if until <= since:
        return 0
    groups = (
        Usage.objects.filter(created_at__gte=since, created_at__lt=until)
        .order_by()
        .annotate(at=TruncHour("created_at", tzinfo=dt.UTC))
        .values("at", "team_id", "api_key_id", "model", "priority_class")
        .annotate(
            requests=Count("id"),
            completed=Count("id", filter=Q(status=UsageStatus.COMPLETED)),
            rejected=Count("id", filter=Q(status=UsageStatus.REJECTED)),
            unavailable=Count("id", filter=Q(status=UsageStatus.UNAVAILABLE)),
            prompt=Sum("prompt_tokens", filter=BILLED),
            completion=Sum("completion_tokens", filter=BILLED),
        )
    )
    rows = [
        UsageHourly(
            hour=g["at"],
            team_id=g["team_id"],
            api_key_id=g["api_key_id"],
            model=g["model"],
            priority_class=g["priority_class"],
            requests=g["requests"],
            completed=g["completed"],
            rejected=g["rejected"],
            unavailable=g["unavailable"],
            failed=g["requests"] - g["completed"] - g["rejected"] - g["unavailable"],
            prompt_tokens=g["prompt"] or 0,
            completion_tokens=g["completion"] or 0,
        )
        for g in groups
    ]
    days = {since.date() + dt.timedelta(days=n) for n in range((until - since).days + 2)}
    closed = closed_days(days)
    rows = [row for row in rows if row.hour.astimezone(dt.UTC).date() not in closed]
    with transaction.atomic():
        stale = UsageHourly.objects.filter(hour__gte=since, hour__lt=until)
        for day in closed:
            stale = stale.exclude(hour__gte=day_start(day), hour__lt=day_start(day + dt.timedelta(days=1)))
        stale.delete()
        UsageHourly.objects.bulk_create(rows, batch_size=1000)
    return len(rows)


def usage_rollup_daily(*, day: dt.date) -> int:
    """Recompute the daily rows of `day` by summing its hourly rows; returns how many rows.
    A closed day keeps its rows as they are."""
    if UsageDaily.objects.filter(day=day, closed=True).exists():
        return UsageDaily.objects.filter(day=day).count()
    groups = (
        UsageHourly.objects.filter(hour__gte=day_start(day), hour__lt=day_start(day + dt.timedelta(days=1)))
        .order_by()
        .values("team_id", "api_key_id", "model", "priority_class")
        .annotate(
            n=Sum("requests"),
            ok=Sum("completed"),
            refused=Sum("rejected"),
            outages=Sum("unavailable"),
            bad=Sum("failed"),
            prompt=Sum("prompt_tokens"),
            completion=Sum("completion_tokens"),
        )
    )
    rows = [
        UsageDaily(
            day=day,
            team_id=g["team_id"],
            api_key_id=g["api_key_id"],
            model=g["model"],
            priority_class=g["priority_class"],
            requests=g["n"],
            completed=g["ok"],
            rejected=g["refused"],
            unavailable=g["outages"],
            failed=g["bad"],
            prompt_tokens=g["prompt"] or 0,
            completion_tokens=g["completion"] or 0,
        )
        for g in groups
    ]
    with transaction.atomic():
        UsageDaily.objects.filter(day=day).delete()
        UsageDaily.objects.bulk_create(rows)
    return len(rows)


def usage_rollup(*, day: dt.date) -> int:
    """Recompute the hourly rows of `day` from its usage records, and its daily rows from those;
    returns how many daily rows. A closed day (its records deleted by `usage_prune`) keeps its
    rows as they are."""
    with transaction.atomic():
        usage_rollup_hours(since=day_start(day), until=day_start(day + dt.timedelta(days=1)))
        return usage_rollup_daily(day=day)


def usage_rollup_recent(*, now: dt.datetime | None = None) -> list[dt.datetime]:
    """The periodic rollup: recompute each hour the flush stored records in since the last run
    (the current hour included whenever traffic flows; a backlog flushed after an outage marks
    its old hours too), then those hours' days. Returns the hours recomputed.

    Reads one hour of records per hour touched, never a whole day, whatever the traffic."""
    client = gateway_redis()
    key = redis_keys().usage_hours
    with client.pipeline(transaction=True) as pipe:
        pipe.smembers(key)
        pipe.delete(key)
        members, _ = pipe.execute()
    hours = sorted(dt.datetime.fromtimestamp(int(m), tz=dt.UTC) for m in members)
    try:
        for start, end in _hour_runs(hours):
            usage_rollup_hours(since=start, until=end)
        for day in sorted({h.date() for h in hours}):
            usage_rollup_daily(day=day)
    except BaseException:
        # Not recomputed: marked again for the next run (the failure is still raised).
        if members:
            with contextlib.suppress(redis.RedisError):
                client.sadd(key, *members)
        raise
    return hours


def _hour_runs(hours: list[dt.datetime]) -> list[tuple[dt.datetime, dt.datetime]]:
    """Consecutive hours merged into [start, end) ranges: one query per run of hours."""
    runs: list[tuple[dt.datetime, dt.datetime]] = []
    for hour in hours:
        if runs and runs[-1][1] == hour:
            runs[-1] = (runs[-1][0], hour + dt.timedelta(hours=1))
        else:
            runs.append((hour, hour + dt.timedelta(hours=1)))
    return runs
