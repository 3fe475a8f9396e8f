"""A year of usage on PostgreSQL: the table partitioned by UTC day, partitions made ahead, strays
moved out of the DEFAULT partition, retention dropping whole days after rolling them up, hourly
rollups of the hours the flush touched, and pages that never read more than a day of records."""

from __future__ import annotations

import datetime as dt
import re
import uuid

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from portal.core.redis.client import redis_keys
from portal.dashboard.services import retention_prune
from portal.teams import partitions
from portal.teams.models import Usage, UsageDaily, UsageHourly
from portal.teams.selectors import usage_hourly_series
from portal.teams.services import usage_flush, usage_partitions_maintain, usage_rollup_recent
from tests.helpers.usage import push, record

pytestmark = pytest.mark.django_db


def _today() -> dt.date:
    return timezone.now().astimezone(dt.UTC).date()


def _at(day: dt.date, hour: int = 10, minute: int = 0) -> dt.datetime:
    return dt.datetime.combine(day, dt.time(hour, minute), tzinfo=dt.UTC)


def _home(request_id: str) -> str:
    """The partition a usage row is stored in."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT tableoid::regclass::text FROM teams_usage WHERE request_id = %s", [request_id])
        return cursor.fetchone()[0]


def test_the_migration_made_the_usage_table_partitioned_by_day_with_days_ahead_and_a_default():
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT partstrat, a.attname FROM pg_partitioned_table p "
            "JOIN pg_attribute a ON a.attrelid = p.partrelid AND a.attnum = p.partattrs[0] "
            "WHERE p.partrelid = 'teams_usage'::regclass"
        )
        assert cursor.fetchone() == ("r", "created_at")  # RANGE on created_at
        cursor.execute(
            "SELECT count(*) FROM pg_partitioned_table WHERE partdefid = 'teams_usage_default'::regclass"
        )
        assert cursor.fetchone() == (1,)
    days = partitions.usage_partitions()
    today = _today()
    # The test database was migrated at most a few hours ago: its days ahead are still there.
    assert {today + dt.timedelta(days=n) for n in range(0, 7)} <= set(days)
    assert days[today] == f"teams_usage_p{today:%Y%m%d}"


def test_the_task_makes_the_partitions_ahead_and_moves_stray_rows_out_of_the_default(team, key, gw, settings):
    settings.USAGE_PARTITIONS_AHEAD_DAYS = 10
    later = _today() + dt.timedelta(days=40)  # no partition yet: the row lands in DEFAULT, not lost
    stray = record(team, key, when=_at(later))
    push(gw, stray)
    assert usage_flush() == 1
    assert _home(stray["request_id"]) == "teams_usage_default"

    from portal.teams.tasks import usage_partitions_maintain as task

    created = task.apply(kwargs={}).get()
    assert later.isoformat() in created  # the stray row's day got its own
    assert _home(stray["request_id"]) == f"teams_usage_p{later:%Y%m%d}"

    ahead = usage_partitions_maintain(today=later)
    assert ahead == [later + dt.timedelta(days=n) for n in range(-1, 11) if n != 0]
    assert set(ahead) <= set(partitions.usage_partitions())
    assert usage_partitions_maintain(today=later) == []  # idempotent
    # Exactly once still holds after the move: the same record flushed again is not stored twice.
    push(gw, stray)
    usage_flush()
    assert Usage.objects.filter(request_id=stray["request_id"]).count() == 1
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM teams_usage_default")
        assert cursor.fetchone() == (0,)


def test_retention_drops_old_day_partitions_after_rolling_them_up_and_keeps_the_rollups(team, settings):
    settings.RETENTION_USAGE_DAYS = 7
    now = _at(_today() + dt.timedelta(days=60), hour=12)
    old, kept = (now - dt.timedelta(days=20)).date(), (now - dt.timedelta(days=1)).date()
    for day in (old, kept):
        assert partitions.partition_create(day)
    for minute in range(4):
        Usage.objects.create(
            created_at=_at(old, hour=9 + minute % 2, minute=minute), team=team, model="m", status="completed",
            http_status=200, prompt_tokens=10, completion_tokens=20, duration_ms=5,
        )  # fmt: skip
    recent = Usage.objects.create(
        created_at=_at(kept), team=team, model="m", status="completed", http_status=200, duration_ms=5
    )

    done = retention_prune(now=now)

    assert done["usage"] == 4
    assert old not in partitions.usage_partitions() and kept in partitions.usage_partitions()
    with connection.cursor() as cursor:
        cursor.execute("SELECT to_regclass(%s)", [partitions.partition_name(old)])
        assert cursor.fetchone() == (None,)  # dropped, not emptied
    assert list(Usage.objects.values_list("pk", flat=True)) == [recent.pk]
    daily = UsageDaily.objects.get(day=old)
    assert (daily.requests, daily.prompt_tokens, daily.completion_tokens, daily.closed) == (4, 40, 80, True)
    hourly = dict(UsageHourly.objects.filter(team=team, hour__date=old).values_list("hour__hour", "requests"))
    assert hourly == {9: 2, 10: 2}
    # A later rollup of the dropped day (nothing left to read) leaves both rollups as they are.
    from portal.teams.services import usage_rollup

    usage_rollup(day=old)
    assert UsageDaily.objects.get(day=old).requests == 4
    assert UsageHourly.objects.filter(team=team, hour__date=old).count() == 2


def test_the_rollup_recomputes_each_hour_the_flush_touched_even_a_backlog_from_yesterday(team, key, gw):
    from portal.teams.models import ApiKey

    now = timezone.now()
    long_ago = now - dt.timedelta(hours=30)  # records held in Redis through an outage
    ApiKey.objects.filter(pk=key.pk).update(created_at=long_ago - dt.timedelta(hours=1))
    push(gw, record(team, key), record(team, key, status="rejected"), record(team, key, when=long_ago))
    usage_flush()
    assert gw.scard(redis_keys().usage_hours) == 2

    hours = usage_rollup_recent()

    hour = now.astimezone(dt.UTC).replace(minute=0, second=0, microsecond=0)
    assert hours == [long_ago.astimezone(dt.UTC).replace(minute=0, second=0, microsecond=0), hour]
    assert UsageHourly.objects.get(hour=hour).requests == 2
    assert UsageHourly.objects.get(hour=hours[0]).requests == 1
    assert UsageDaily.objects.get(day=hours[0].date()).requests == 1  # its day, summed from the hours
    assert UsageDaily.objects.filter(day=hour.date()).get().rejected == 1
    assert gw.scard(redis_keys().usage_hours) == 0
    assert usage_rollup_recent() == []  # nothing flushed since: nothing read


def test_the_hourly_series_reads_rollups_for_past_hours_and_records_for_the_last_two(team, key, gw):
    from portal.teams.models import ApiKey

    now = timezone.now()
    ApiKey.objects.filter(pk=key.pk).update(created_at=now - dt.timedelta(days=2))
    push(gw, *[record(team, key, when=now - dt.timedelta(hours=h)) for h in (0, 0, 1, 5, 5, 5, 23)])
    usage_flush()
    usage_rollup_recent()
    series = dict(usage_hourly_series(team, now=now))
    hour = now.astimezone(dt.UTC).replace(minute=0, second=0, microsecond=0)
    assert [series[hour - dt.timedelta(hours=h)] for h in (0, 1, 5, 23)] == [2, 1, 3, 1]
    assert sum(series.values()) == 7


# --- pages and the API read rollups, never more than one day of usage records ---------------

PAGES = ["/", "/teams/{slug}/usage/", "/teams/{slug}/keys/", "/admin/teams/usage/",
         "/admin/teams/usagedaily/", "/admin/teams/usagehourly/", "/api/v1/teams/",
         "/deployments/", "/admin/teams/usage/?day={long_ago}"]  # fmt: skip
RAW_TABLE = re.compile(r'(FROM|JOIN) "teams_usage"(?![a-z_])')
LOWER_BOUND = re.compile(r'"teams_usage"\."created_at" >= \'([^\']+)\'')
UPPER_BOUND = re.compile(r'"teams_usage"\."created_at" < \'([^\']+)\'')


def _raw_reads(queries) -> list[str]:
    return [q["sql"] for q in queries if RAW_TABLE.search(q["sql"])]


def _span(sql: str, now: dt.datetime) -> dt.timedelta | None:
    """How much time of records a query reads: from its lower bound on created_at to its upper
    bound, or to now (None: no lower bound, the whole table)."""
    lower = [dt.datetime.fromisoformat(value) for value in LOWER_BOUND.findall(sql)]
    upper = [dt.datetime.fromisoformat(value) for value in UPPER_BOUND.findall(sql)]
    return (max(upper) if upper else now) - min(lower) if lower else None


@pytest.mark.usefixtures("metrics_redis")
def test_no_page_or_api_reads_more_than_one_day_of_usage_records(client, team, bob, admin_user):
    now = timezone.now()
    Usage.objects.create(
        created_at=now, team=team, model="m", status="completed", http_status=200, duration_ms=1
    )
    for user in (bob, admin_user):
        client.force_login(user)
        for page in PAGES:
            url = page.format(slug=team.slug, long_ago=(now - dt.timedelta(days=9)).date().isoformat())
            with CaptureQueriesContext(connection) as queries:
                response = client.get(url)
            if response.status_code in (302, 403, 404):
                continue  # not this user's page
            assert response.status_code == 200, url
            for sql in _raw_reads(queries.captured_queries):
                span = _span(sql, timezone.now())
                assert span is not None, f"{url} reads usage records without a time bound: {sql}"
                assert span <= dt.timedelta(days=1, minutes=1), f"{url} reads {span} of records: {sql}"


def test_the_guard_catches_a_read_of_more_than_a_day():
    # The check itself, on a query that scans a week: it must not pass by matching nothing.
    week = timezone.now() - dt.timedelta(days=7)
    with CaptureQueriesContext(connection) as queries:
        list(Usage.objects.filter(created_at__gte=week).values_list("pk"))
    (sql,) = _raw_reads(queries.captured_queries)
    assert _span(sql, timezone.now()) > dt.timedelta(days=6)
    with CaptureQueriesContext(connection) as queries:
        Usage.objects.count()
    (sql,) = _raw_reads(queries.captured_queries)
    assert _span(sql, timezone.now()) is None


def test_a_request_id_is_stored_once_per_arrival_time_across_batches(team, key, gw):
    same = record(team, key, request_id=uuid.uuid4().hex)
    push(gw, same)
    usage_flush()
    push(gw, same, same)
    usage_flush()
    assert Usage.objects.filter(request_id=same["request_id"]).count() == 1


@pytest.mark.django_db(transaction=True)
def test_dropping_a_partition_behind_a_long_read_never_holds_up_the_flush(team, key):
    """DROP waits for the table's exclusive lock behind a long read (a report, pg_dump), and every
    insert of the flush queued behind it (9.7 s behind a 10 s read in perf.partition_drop_stall).
    Now each attempt waits 0.2 s at most, and inserts go through between attempts."""
    import threading
    import time

    import psycopg
    from django.db import connections, transaction

    from portal.teams.services import usage_insert, usage_prune

    def row(when: dt.datetime) -> Usage:
        return Usage(
            request_id=uuid.uuid4(), created_at=when, team=team, api_key=key, status="completed",
            http_status=200, duration_ms=1.0,
        )  # fmt: skip

    day = _today() - dt.timedelta(days=10)
    partitions.partition_create(day)
    with transaction.atomic():
        usage_insert([row(_at(day))])
    db = connection.settings_dict
    reader = psycopg.connect(host=db["HOST"], port=db["PORT"], user=db["USER"], dbname=db["NAME"])
    reader.execute("SELECT count(*) FROM teams_usage")  # its transaction holds the table until it ends
    pruned: dict[str, int] = {}

    def prune() -> None:
        try:
            pruned["records"] = usage_prune(before=day + dt.timedelta(days=1), batch_size=100)
        finally:
            connections.close_all()

    thread = threading.Thread(target=prune)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        with connection.cursor() as cursor:  # the prune asks for the table's lock, behind the reader
            while True:
                cursor.execute(
                    "SELECT count(*) FROM pg_locks WHERE NOT granted AND relation = 'teams_usage'::regclass"
                )
                if cursor.fetchone()[0]:
                    break
                assert time.monotonic() < deadline, "the prune never asked for the table's lock"
        started = time.monotonic()
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("SET LOCAL lock_timeout = '5s'")  # the old drop held the queue for 30 s
            usage_insert([row(timezone.now())])
        assert time.monotonic() - started < 5
    finally:
        reader.rollback()
        reader.close()
        thread.join(timeout=120)
    assert pruned == {"records": 1}
    assert day not in partitions.usage_partitions()
    assert UsageDaily.objects.get(day=day).closed
