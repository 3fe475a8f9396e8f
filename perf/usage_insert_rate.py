"""How fast usage rows go into the partitioned usage table: the flush against the alternatives.

    .venv/bin/python -m perf.usage_insert_rate [--rows 20000] [--repeats 3]
        [--admin-url postgres://postgres@127.0.0.1:5432/postgres]

A throwaway world: its own PostgreSQL database on the machine's server (created, migrated, so
`teams_usage` is partitioned by day exactly as in production, and dropped at the end) and a
private `redis-server`. For each method it inserts `--rows` fresh rows for today, in
transactions of one flush batch each, and prints rows/s (median of `--repeats`) and the ratio to
the fleet's 2,000 requests/s (docs/scale.md):

- `usage_flush` as the beat task runs it: records pushed to Redis as the gateway's `FINISH` does
  (JSON, RPUSH; not timed), then the flush timed: take a leased batch, parse, check teams and
  keys, insert, touch `last_used_at`, mark the hours for the rollup. Once with its insert step
  (COPY into a temporary table, INSERT ... ON CONFLICT DO NOTHING) and once with the step it had
  before (`bulk_create(ignore_conflicts=True)`);
- the insert step alone, rows already built: `bulk_create` in batches of 500 and 2,000 with and
  without the dedup (ON CONFLICT DO NOTHING), COPY straight into the table (no dedup: a
  replayed batch would fail), and COPY through the temporary table (the flush's step).

Then the table's size per row (`pg_total_relation_size` over every partition, indexes
included) and the hourly rollup's rate over the rows stored.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from devtools import free_port, stop
from perf._common import spawn, table, wait_redis

FLEET_RATE = 2000  # requests/s: 100 nodes (docs/scale.md)
FLUSH_BATCH = 1000  # usage_flush's default batch


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=20000, help="rows per method and repetition")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--admin-url",
        default=os.environ.get("PERF_ADMIN_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/postgres"),
        help="a PostgreSQL database to connect to for CREATE/DROP DATABASE",
    )
    args = p.parse_args(argv)
    if args.rows < 1 or args.repeats < 1:
        p.error("--rows and --repeats must be at least 1")
    return args


def _admin(url: str, sql: str) -> None:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(sql)


def _database_url(admin_url: str, name: str) -> str:
    return admin_url.rsplit("/", 1)[0] + "/" + name


def setup(directory: Path, database_url: str) -> subprocess.Popen:
    """The private Redis and the environment; Django set up against the throwaway database."""
    if shutil.which("redis-server") is None:
        raise SystemExit("redis-server is not installed: the benchmark runs its own private Redis")
    port = free_port()
    redis_server = spawn(
        ["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no",
         "--dir", str(directory)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
    )  # fmt: skip
    wait_redis(port, redis_server)
    os.environ.update(
        {
            "DJANGO_SETTINGS_MODULE": "portal.settings",
            "DATABASE_URL": database_url,
            "REDIS_URL": f"redis://127.0.0.1:{port}/0",
            "GATEWAY_REDIS_URL": f"redis://127.0.0.1:{port}/0",
            "PORTAL_REDIS_NAMESPACE": "insert-bench",
            "PORTAL_RUN_DIR": str(directory / "run"),
            "SECRET_KEY": "insert-bench-only-secret-key-0123456789abcdefghijklmnop",
            "SECURE_SSL_REDIRECT": "false",
            "DEBUG": "false",
            "LOG_LEVEL": "WARNING",
        }
    )
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    return redis_server


def _records(team_id: int, key_id: int, n: int, at: dt.datetime) -> list[dict]:
    """Records as the gateway queues them (portal/gateway/usage.py), spread over the last minute."""
    return [
        {
            "request_id": uuid.uuid4().hex,
            "created_at": at.timestamp() - (i % 60),
            "team_id": team_id,
            "api_key_id": key_id,
            "model": "llama-2-7b-chat-hf",
            "deployment_id": None,
            "endpoint": "chat/completions",
            "stream": True,
            "status": "completed" if i % 20 else "rejected",
            "http_status": 200 if i % 20 else 429,
            "error_code": "",
            "prompt_tokens": 200 + i % 300,
            "completion_tokens": 300 + i % 200,
            "ttft_ms": 80.0 + i % 50,
            "duration_ms": 4000.0 + i % 900,
        }
        for i in range(n)
    ]


def _rows(records: list[dict]):
    from portal.teams.services.usage_queue import usage_row
    from portal.teams.usage_record import UsageRecord

    return [usage_row(UsageRecord.from_json(json.dumps(r).encode())) for r in records]


def _timed_batches(rows: list, size: int, insert: Callable[[list], None]) -> float:
    from django.db import transaction

    started = time.perf_counter()
    for i in range(0, len(rows), size):
        with transaction.atomic():
            insert(rows[i : i + size])
    return time.perf_counter() - started


def _copy_plain(rows: list) -> None:
    """COPY straight into the partitioned table: no dedup (a replayed batch fails the batch)."""
    from django.db import connection

    from portal.teams.models import Usage
    from portal.teams.services.usage_queue import _usage_columns

    fields = _usage_columns()
    columns = ", ".join(connection.ops.quote_name(f.column) for f in fields)
    with (
        connection.cursor() as cursor,
        cursor.cursor.copy(f"COPY {Usage._meta.db_table} ({columns}) FROM STDIN") as copy,
    ):
        for row in rows:
            copy.write_row([getattr(row, f.attname) for f in fields])


def run(args) -> list[list[str]]:
    from django.db import connection

    from portal.core.redis.client import gateway_redis, redis_keys
    from portal.teams import services
    from portal.teams.models import Team, Usage, UsageHourly
    from portal.teams.services import api_key_create, team_create, usage_flush, usage_insert, usage_queue

    team = team_create(slug="bench")
    key, _ = api_key_create(team=team)
    client = gateway_redis()

    def bulk(size: int, dedup: bool) -> Callable[[list], float]:
        return lambda rows: _timed_batches(
            rows, size, lambda batch: Usage.objects.bulk_create(batch, ignore_conflicts=dedup)
        )

    def flush(insert: Callable[[list], None]) -> Callable[[list], float]:
        def timed(rows_records: list) -> float:
            records = rows_records
            for i in range(0, len(records), 1000):
                client.rpush(redis_keys().usage, *[json.dumps(r) for r in records[i : i + 1000]])
            real = usage_queue.usage_insert
            usage_queue.usage_insert = insert
            try:
                started = time.perf_counter()
                stored = usage_flush(batch=FLUSH_BATCH)
                elapsed = time.perf_counter() - started
            finally:
                usage_queue.usage_insert = real
            assert stored == len(records), (stored, len(records))
            return elapsed

        return timed

    methods: list[tuple[str, bool, Callable[[list], float]]] = [
        # (name, takes records (True) or built rows, timed run)
        ("usage_flush, COPY → temp table → INSERT ON CONFLICT (now)", True, flush(usage_insert)),
        ("usage_flush, bulk_create ON CONFLICT (before)", True,
         flush(lambda rows: Usage.objects.bulk_create(rows, ignore_conflicts=True))),
        ("bulk_create × 500, ON CONFLICT DO NOTHING", False, bulk(500, True)),
        ("bulk_create × 2000, ON CONFLICT DO NOTHING", False, bulk(2000, True)),
        ("bulk_create × 2000, no dedup", False, bulk(2000, False)),
        ("COPY × 1000 into the table, no dedup", False, lambda rows: _timed_batches(rows, 1000, _copy_plain)),
        ("COPY × 1000 → temp table → INSERT ON CONFLICT", False,
         lambda rows: _timed_batches(rows, 1000, usage_insert)),
    ]  # fmt: skip
    rates: dict[str, list[float]] = {name: [] for name, _, _ in methods}
    for repeat in range(args.repeats):
        # The order rotates each repetition: no method always runs on the emptiest table.
        for name, takes_records, timed in methods[repeat % len(methods) :] + methods[: repeat % len(methods)]:
            records = _records(team.pk, key.pk, args.rows, dt.datetime.now(dt.UTC))
            elapsed = timed(records if takes_records else _rows(records))
            rates[name].append(args.rows / elapsed)
    out = []
    for name, _, _ in methods:
        median = statistics.median(rates[name])
        out.append([name, f"{median:,.0f}", f"{median / FLEET_RATE:.1f}×",
                    f"{min(rates[name]):,.0f}–{max(rates[name]):,.0f}"])  # fmt: skip

    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT sum(pg_total_relation_size(relid)) FROM pg_partition_tree('teams_usage') WHERE isleaf"
        )
        (size,) = cursor.fetchone()
    count = Usage.objects.count()
    started = time.perf_counter()
    now = dt.datetime.now(dt.UTC)
    services.usage_rollup_hours(since=now - dt.timedelta(hours=2), until=now + dt.timedelta(hours=1))
    rollup_s = time.perf_counter() - started
    assert sum(UsageHourly.objects.values_list("requests", flat=True)) == count
    assert Team.objects.count() == 1
    summary = [
        ["rows stored", f"{count:,}", "", ""],
        ["bytes per row (table + indexes, all partitions)", f"{size / count:,.0f}", "", ""],
        ["hourly rollup over them, rows/s", f"{count / rollup_s:,.0f}", "", ""],
    ]
    return out, summary


def main(argv=None) -> int:
    args = parse_args(argv)
    name = f"portal_insert_bench_{os.getpid()}"
    directory = Path(tempfile.mkdtemp(prefix="usage-insert-"))
    print(f"setting up in {directory}, database {name}", flush=True)
    _admin(args.admin_url, f"CREATE DATABASE {name}")
    redis_server = None
    try:
        redis_server = setup(directory, _database_url(args.admin_url, name))
        load = os.getloadavg()
        rows, summary = run(args)
        print(f"\n{args.rows:,} rows per method, {args.repeats} repetitions, load average "
              f"{load[0]:.1f} at the start, {os.cpu_count()} CPUs\n")  # fmt: skip
        print(table(["method", "rows/s (median)", f"÷ {FLEET_RATE:,}/s", "range"], rows))
        print()
        print(table(["measured", "value", "", ""], summary))
    finally:
        from django.db import connections

        with contextlib.suppress(Exception):
            connections.close_all()
        if redis_server is not None:
            stop(redis_server)
        with contextlib.suppress(Exception):
            _admin(args.admin_url, f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        shutil.rmtree(directory, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
