"""Does dropping a day's usage partition stall the usage flush? Measured, not guessed.

    .venv/bin/python -m perf.partition_drop_stall [--old-rows 20000] [--reader-s 3]
        [--admin-url postgres://postgres@127.0.0.1:5432/postgres]

A throwaway PostgreSQL database (created, migrated so `teams_usage` is partitioned by day as in
production, dropped at the end). A flusher thread inserts batches of 200 rows for today through
`usage_insert` (the flush's COPY → temporary table → INSERT step), each in its own transaction,
and times every batch. Meanwhile a reader holds a transaction that read the usage table for
`--reader-s` seconds (a report, a dashboard query, pg_dump), and retention prunes an old day
(`usage_prune`, which drops that day's partition). Prints the flush's batch latency before and
during the prune, and how long the prune took.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import tempfile
import threading
import time
import uuid

from perf._common import table

BATCH = 200


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--old-rows", type=int, default=20000, help="rows in the day that is dropped")
    p.add_argument("--reader-s", type=float, default=3.0, help="how long the reader's transaction lasts")
    p.add_argument(
        "--admin-url",
        default=os.environ.get("PERF_ADMIN_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/postgres"),
    )
    args = p.parse_args(argv)
    if args.old_rows < 1 or not 0 <= args.reader_s <= 60:
        p.error("--old-rows must be at least 1 and --reader-s from 0 to 60")
    return args


def _admin(url: str, sql: str) -> None:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(sql)


def _rows(team_id: int, key_id: int, n: int, at: dt.datetime) -> list:
    from portal.teams.models import Usage

    return [
        Usage(
            request_id=uuid.uuid4(),
            created_at=at - dt.timedelta(seconds=i % 3600),
            team_id=team_id,
            api_key_id=key_id,
            model="llama-2-7b-chat-hf",
            endpoint="chat",
            status="completed",
            http_status=200,
            prompt_tokens=200,
            completion_tokens=300,
            duration_ms=4000.0,
        )
        for i in range(n)
    ]


def measure(args, database_url: str) -> list[list[str]]:
    import psycopg
    from django.db import connection, transaction

    from portal.teams import partitions
    from portal.teams.services import api_key_create, team_create, usage_insert, usage_prune

    team = team_create(slug="stall")
    key, _ = api_key_create(team=team)
    now = dt.datetime.now(dt.UTC)
    today = now.date()
    old_day = today - dt.timedelta(days=5)
    for n in range(-5, 2):
        partitions.partition_create(today + dt.timedelta(days=n))
    with transaction.atomic():
        usage_insert(_rows(team.pk, key.pk, args.old_rows, dt.datetime.combine(old_day, dt.time(12), dt.UTC)))

    latencies: list[tuple[float, float]] = []  # (start, seconds)
    stop = threading.Event()

    def flusher() -> None:
        while not stop.is_set():
            rows = _rows(team.pk, key.pk, BATCH, dt.datetime.now(dt.UTC))
            started = time.perf_counter()
            with transaction.atomic():
                usage_insert(rows)
            latencies.append((started, time.perf_counter() - started))
        connection.close()

    def reader(holding: threading.Event) -> None:
        with psycopg.connect(database_url) as conn:  # one transaction: its lock lasts until the end
            conn.execute("SELECT count(*) FROM teams_usage WHERE created_at >= now() - interval '1 hour'")
            holding.set()
            time.sleep(args.reader_s)
            conn.rollback()

    thread = threading.Thread(target=flusher)
    thread.start()
    time.sleep(2.0)
    holding = threading.Event()
    reading = threading.Thread(target=reader, args=(holding,))
    reading.start()
    holding.wait()
    prune_start = time.perf_counter()
    pruned = usage_prune(before=old_day + dt.timedelta(days=1), batch_size=1000)
    prune_s = time.perf_counter() - prune_start
    reading.join()
    time.sleep(1.0)
    stop.set()
    thread.join()
    assert pruned == args.old_rows, pruned
    assert old_day not in partitions.usage_partitions()
    before = [s for t, s in latencies if t < prune_start - 0.1]
    during = [s for t, s in latencies if prune_start - 0.1 <= t <= prune_start + prune_s]
    ms = lambda xs: f"{1000 * max(xs):.0f}" if xs else "—"  # noqa: E731
    p50 = lambda xs: f"{1000 * statistics.median(xs):.0f}" if xs else "—"  # noqa: E731
    return [
        ["before the prune", str(len(before)), p50(before), ms(before), ""],
        ["during the prune", str(len(during)), p50(during), ms(during), f"{prune_s:.2f}"],
    ]


def main(argv=None) -> None:
    args = parse_args(argv)
    name = f"stall_{uuid.uuid4().hex[:8]}"
    database_url = args.admin_url.rsplit("/", 1)[0] + "/" + name
    _admin(args.admin_url, f'CREATE DATABASE "{name}"')
    try:
        with tempfile.TemporaryDirectory() as directory:
            os.environ.update(
                {
                    "DJANGO_SETTINGS_MODULE": "portal.settings",
                    "DATABASE_URL": database_url,
                    "PORTAL_REDIS_NAMESPACE": "stall-bench",
                    "PORTAL_RUN_DIR": directory,
                    "SECRET_KEY": "stall-bench-only-secret-key-0123456789abcdefghijklmnop",
                    "SECURE_SSL_REDIRECT": "false",
                    "DEBUG": "false",
                    "LOG_LEVEL": "WARNING",
                }
            )
            import django

            django.setup()
            from django.core.management import call_command
            from django.db import connections

            call_command("migrate", verbosity=0)
            rows = measure(args, database_url)
            connections.close_all()
        print(f"old day: {args.old_rows} rows; a reader holds the usage table for {args.reader_s:g} s")
        print(table(["phase", "flush batches", "P50 ms", "max ms", "prune s"], rows))
    finally:
        _admin(args.admin_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


if __name__ == "__main__":
    main()
