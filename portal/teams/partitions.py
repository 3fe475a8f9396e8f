"""The usage table's daily partitions on PostgreSQL: names, creation ahead, strays, dropping.

`teams_usage` is `PARTITION BY RANGE (created_at)` (migration 0006): one partition per UTC
day, `teams_usage_pYYYYMMDD`, plus a DEFAULT partition that catches a row for a day without
one (a record from a skewed clock, a late record of a day already dropped), so no insert ever
fails for want of a partition. The daily maintenance creates the days ahead and moves any
stray rows out of the DEFAULT partition into their day's own. On SQLite the table is plain and
every function here is a no-op: callers check `usage_is_partitioned()`.

Low-level DDL only (no rollups, no policy): `portal/teams/services/retention.py` decides what to create
and drop and when.
"""

from __future__ import annotations

import datetime as dt
import re

from django.db import OperationalError, connection, transaction

from .models import Usage

PARTITION_RE = re.compile(r"_p(\d{8})$")
LOCK_NOT_AVAILABLE = "55P03"  # PostgreSQL's error for a lock_timeout
# Serializes partition DDL between concurrent maintenance runs (an arbitrary constant).
_DDL_LOCK = 0x7573_6167  # "usag"


def usage_table() -> str:
    return Usage._meta.db_table


def partition_name(day: dt.date) -> str:
    return f"{usage_table()}_p{day:%Y%m%d}"


def default_partition_name() -> str:
    return f"{usage_table()}_default"


def _bounds(day: dt.date) -> tuple[str, str]:
    # Literals, not parameters: DDL takes no bound parameters. Dates only, so nothing to escape.
    return f"'{day.isoformat()} 00:00:00+00'", f"'{(day + dt.timedelta(days=1)).isoformat()} 00:00:00+00'"


def usage_is_partitioned() -> bool:
    if connection.vendor != "postgresql":
        return False
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT 1 FROM pg_partitioned_table WHERE partrelid = to_regclass(%s)", [usage_table()]
        )
        return cursor.fetchone() is not None


def usage_partitions() -> dict[dt.date, str]:
    """Each day that has a partition of its own, oldest first (the DEFAULT partition left out)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
            "WHERE i.inhparent = to_regclass(%s)",
            [usage_table()],
        )
        names = [name for (name,) in cursor.fetchall()]
    days = {}
    for name in names:
        match = PARTITION_RE.search(name)
        if match:
            days[dt.datetime.strptime(match.group(1), "%Y%m%d").date()] = name
    return dict(sorted(days.items()))


def default_partition_days() -> list[dt.date]:
    """The UTC days of the rows in the DEFAULT partition (normally none)."""
    with connection.cursor() as cursor:
        default = connection.ops.quote_name(default_partition_name())
        cursor.execute(f"SELECT DISTINCT (created_at AT TIME ZONE 'UTC')::date FROM {default} ORDER BY 1")  # noqa: S608
        return [day for (day,) in cursor.fetchall()]


def partition_create(day: dt.date) -> bool:
    """Give `day` a partition of its own, moving its rows out of the DEFAULT partition (attaching a
    range whose rows sit in DEFAULT would fail). False if it already had one."""
    name = partition_name(day)
    quote = connection.ops.quote_name
    lower, upper = _bounds(day)
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SELECT pg_advisory_xact_lock(%s)", [_DDL_LOCK])
        if day in usage_partitions():
            return False
        cursor.execute(f"CREATE TABLE {quote(name)} (LIKE {quote(usage_table())} INCLUDING DEFAULTS)")
        # A CHECK matching the range lets ATTACH skip scanning the new table.
        cursor.execute(
            f"ALTER TABLE {quote(name)} ADD CONSTRAINT {quote(name + '_range')} "
            f"CHECK (created_at >= {lower} AND created_at < {upper})"
        )
        cursor.execute(
            f"WITH moved AS (DELETE FROM {quote(default_partition_name())} "  # noqa: S608
            f"WHERE created_at >= {lower} AND created_at < {upper} RETURNING *) "
            f"INSERT INTO {quote(name)} SELECT * FROM moved"
        )
        cursor.execute(
            f"ALTER TABLE {quote(usage_table())} ATTACH PARTITION {quote(name)} "
            f"FOR VALUES FROM ({lower}) TO ({upper})"
        )
        cursor.execute(f"ALTER TABLE {quote(name)} DROP CONSTRAINT {quote(name + '_range')}")
    return True


def partition_drop(day: dt.date, *, lock_timeout_s: float) -> bool:
    """Drop `day`'s partition with its rows, in a transaction of its own; False if its lock did not
    come within `lock_timeout_s`. DROP takes an exclusive lock on the parent table: while it
    waits for one (behind a long read: a report, pg_dump), every later query of the table, the
    usage flush's inserts included, queues behind it. The timeout bounds that queue; the caller
    tries again after letting the queue drain."""
    quote = connection.ops.quote_name
    try:
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute(f"SET LOCAL lock_timeout = '{max(1, int(lock_timeout_s * 1000))}ms'")
            cursor.execute(f"DROP TABLE IF EXISTS {quote(partition_name(day))}")
    except OperationalError as error:
        if getattr(error.__cause__, "sqlstate", None) == LOCK_NOT_AVAILABLE:
            return False
        raise
    return True
