"""The usage queue: records the gateway queued in Redis, moved into the database in batches.

The gateway pushes one `UsageRecord` per request (`portal/teams/usage_record.py`) onto the
usage list; `usage_flush` takes batches off it (Lua, so two flushers never take the same
records), stores them (COPY on PostgreSQL) and dead-letters what it cannot store; ops replay
or purge the dead letters (`manage.py usage_dead_letters`).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import logging
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import redis
from django.db import DataError, IntegrityError, connection, transaction
from django.db.models import Q

from portal.core.redis.client import gateway_redis, redis_keys
from portal.core.redis.keys import USAGE_DEAD_LETTERS, RedisKeys
from portal.core.redis.scripts import (
    USAGE_CLOSE_LAPSED,
    USAGE_GIVE_BACK,
    USAGE_REPLAY,
    USAGE_TAKE,
    UsageCloseLapsedCall,
    UsageGiveBackCall,
    UsageReplayCall,
    UsageTakeCall,
)

from ..models import ApiKey, Team, Usage, UsageSource
from ..usage_record import UnreadableUsageRecord, UsageRecord
from .rollups import closed_days

log = logging.getLogger("portal.teams")

# How long a flusher may hold a batch it took before another flusher puts it back on the
# queue (a worker that died mid-batch). A batch of 1000 takes well under a second to store;
# a batch stored twice is harmless (one row per request id).
USAGE_BATCH_LEASE_MS = 120_000
# How far a web host's clock (a record's created_at) may lag the database's (a key's created_at).
USAGE_CLOCK_SKEW = dt.timedelta(minutes=5)
# The dead-letter list keeps the newest this many records (a flood of foreign records must
# not fill Redis); every one is counted in /metrics whether or not it is kept.
USAGE_DEAD_MAX = 100_000

# --- the flush ----------------------------------------------------------------------------


# What storing a row can raise for a value it cannot hold: PostgreSQL's refusals (through Django, or
# straight from psycopg's COPY), and Django's own when a field's value is of the wrong type (an
# http_status of "abc").
_REFUSED_ERRORS: tuple[type[Exception], ...] = (DataError, IntegrityError, ValueError, TypeError)
try:  # PostgreSQL's driver; a SQLite installation (a single GPU node, `make run`) runs without it
    import psycopg

    _REFUSED_ERRORS += (psycopg.DataError, psycopg.IntegrityError)
except ImportError:  # pragma: no cover - every CI machine has it
    pass

# Why a usage record went to the dead-letter list (the `reason` label in /metrics).
UNREADABLE = "unreadable"
UNKNOWN_TEAM = "unknown_team"
UNKNOWN_KEY = "unknown_key"
REFUSED = "refused_by_database"
# A record of a UTC day retention has closed (rolled up for good, its records deleted): stored, it
# would never be counted and would go at the next prune. Replaying it cannot help; ops purge it.
DAY_CLOSED = "day_closed"


# Which of these deployment ids still exist. Deployments sit above teams (docs/architecture.md
# #layers): teams does not query them; the deployments app gives the flush its selector when it
# loads (`DeploymentsConfig.ready`). Until then every id counts as gone: a row is stored unlinked,
# never linked to a deployment nobody checked.
DeploymentIdsExisting = Callable[[set[int]], set[int]]


def _none_known(ids: set[int]) -> set[int]:
    return set()


_deployment_ids_existing: DeploymentIdsExisting = _none_known


def usage_deployment_check_set(check: DeploymentIdsExisting) -> None:
    """Set how the flush learns which deployment ids of a batch still exist (deployments' selector)."""
    global _deployment_ids_existing
    _deployment_ids_existing = check


def _storable(text: object, limit: int) -> str:
    """Text PostgreSQL can hold: one record with a NUL or a lone surrogate must not fail a whole batch."""
    text = str(text or "").replace("\x00", "")
    return text.encode("utf-8", "replace").decode()[:limit]


def usage_row(record: UsageRecord, *, source: str = UsageSource.GATEWAY, batch_id: str = "") -> Usage:
    """The row of a record, its text cut to what the columns hold (a batch line's row names its
    source and batch: portal/batches/runner.py stores it with the line's result)."""
    return Usage(
        source=source,
        batch_id=batch_id,
        request_id=record.request_id,
        created_at=record.created_at,
        team_id=record.team_id,
        api_key_id=record.api_key_id,
        model=_storable(record.model, 100),
        deployment_id=record.deployment_id,
        endpoint=_storable(record.endpoint, 30),
        priority_class=record.priority_class,
        stream=record.stream,
        status=record.status,
        http_status=record.http_status,
        error_code=_storable(record.error_code, 50),
        prompt_tokens=record.prompt_tokens,
        completion_tokens=record.completion_tokens,
        ttft_ms=record.ttft_ms,
        duration_ms=record.duration_ms,
    )


def usage_flush(*, batch: int = 1000) -> int:
    """Move queued usage records from Redis into the database; returns how many were stored.

    Safe to run in several workers at once: each batch is moved, in one step, from the queue
    to a list of the flusher's own, and removed from there only after its rows are committed.
    A flusher that dies leaves its batch there; the next flush puts it back on the queue once
    the batch's lease ran out. A batch stored twice is harmless: (request id, arrival time) is
    unique, both come from the gateway's record, and a second insert of it is a no-op. A record
    that cannot be stored (unreadable, a team or key this database does not know, a value
    PostgreSQL refuses, a day retention has closed) goes to the dead-letter list
    (`RedisKeys.usage_dead`), is counted in /metrics, and the flush goes on.
    """
    client = gateway_redis()
    keys = redis_keys()
    usage_close_lapsed(client, keys)
    take = client.register_script(USAGE_TAKE)
    give_back = client.register_script(USAGE_GIVE_BACK)
    _usage_requeue_abandoned(client, keys, give_back)
    total = 0
    while True:
        flusher = uuid.uuid4().hex
        taken = keys.usage_taken(flusher)
        call = UsageTakeCall(
            usage=keys.usage,
            flushers=keys.usage_flushers,
            batch_list=taken,
            batch_size=batch,
            lease_ms=USAGE_BATCH_LEASE_MS,
            flusher=flusher,
        )
        raws = take(keys=call.keys(), args=call.args())
        if not raws:
            return total
        try:
            stored, dead, hours = _usage_store(raws)
        except BaseException:
            # The database is down or the worker is stopping: the batch goes back to the queue now
            # rather than after its lease (the failure is still raised).
            with contextlib.suppress(redis.RedisError):
                back = UsageGiveBackCall(
                    usage=keys.usage,
                    flushers=keys.usage_flushers,
                    batch_list=taken,
                    flusher=flusher,
                    force="1",
                )
                give_back(keys=back.keys(), args=back.args())
            raise
        with client.pipeline(transaction=True) as pipe:
            now = time.time()
            if dead:
                pipe.rpush(keys.usage_dead, *[_dead_entry(raw, reason, now) for raw, reason in dead])
                pipe.ltrim(keys.usage_dead, -USAGE_DEAD_MAX, -1)
                for reason, n in Counter(reason for _raw, reason in dead).items():
                    field = keys.counter_field((USAGE_DEAD_LETTERS, reason))
                    pipe.hincrby(keys.metrics_counters, field, n)
            if hours:
                pipe.sadd(keys.usage_hours, *hours)
            pipe.delete(taken)
            pipe.zrem(keys.usage_flushers, flusher)
            pipe.execute()
        if dead:
            log.warning("usage flush: %d record(s) dead-lettered: %s", len(dead), Counter(r for _, r in dead))
        total += stored


def usage_close_lapsed(client: redis.Redis, keys: RedisKeys, *, batch: int = 1000) -> int:
    """Queue the `interrupted` record of every request whose gateway process died mid-way (its open
    record's lease lapsed: a live process renews it with the request's slots); returns how many.
    Each bills the request's reservation, which its daily counters still hold, so the database and
    the counters agree (docs/concurrency.md, "Requests whose gateway process died")."""
    close = client.register_script(USAGE_CLOSE_LAPSED)
    total = 0
    while True:
        call = UsageCloseLapsedCall(
            open=keys.usage_open, open_leases=keys.usage_open_leases, usage=keys.usage, batch_size=batch
        )
        queued = int(close(keys=call.keys(), args=call.args()))
        total += queued
        if queued < batch:
            if total:
                log.warning("usage: %d request(s) whose gateway process died recorded as interrupted", total)
            return total


def _dead_entry(raw: bytes, reason: str, at: float) -> str:
    return json.dumps({"reason": reason, "at": at, "record": raw.decode("utf-8", "replace")})


def _usage_requeue_abandoned(client: redis.Redis, keys: RedisKeys, give_back) -> None:
    """Put back on the queue each batch whose flusher's lease ran out (it died before storing it).
    The script judges the lease by Redis's clock; the set holds one member per running flusher."""
    for member in client.zrange(keys.usage_flushers, 0, -1):
        flusher = member.decode() if isinstance(member, bytes) else str(member)
        call = UsageGiveBackCall(
            usage=keys.usage,
            flushers=keys.usage_flushers,
            batch_list=keys.usage_taken(flusher),
            flusher=flusher,
            force="0",
        )
        n = give_back(keys=call.keys(), args=call.args())
        if n:
            log.warning("usage flush: %d record(s) of an abandoned batch put back on the queue", n)


def _usage_store(raws: list[bytes]) -> tuple[int, list[tuple[bytes, str]], set[int]]:
    """Insert a batch; returns (rows stored, [(raw record, why not)] for the rest, the UTC hours
    (epoch seconds) of the rows stored, for the hourly rollup)."""
    dead: list[tuple[bytes, str]] = []
    parsed: list[tuple[bytes, Usage]] = []
    for raw in raws:
        try:
            parsed.append((raw, usage_row(UsageRecord.from_json(raw))))
        except UnreadableUsageRecord:
            dead.append((raw, UNREADABLE))
    teams = set(Team.objects.filter(pk__in={r.team_id for _, r in parsed}).values_list("pk", flat=True))
    keys = {
        pk: (team_id, created_at)
        for pk, team_id, created_at in ApiKey.objects.filter(
            pk__in={r.api_key_id for _, r in parsed if r.api_key_id is not None}
        ).values_list("pk", "team_id", "created_at")
    }
    linked = {r.deployment_id for _, r in parsed if r.deployment_id is not None}
    deployments = _deployment_ids_existing(linked) if linked else set()
    rows: list[tuple[bytes, Usage]] = []
    for raw, row in parsed:
        # Records of another installation (a shared Redis) or of a team deleted since: refused,
        # not stored under a stranger's id or without a key. A record older than its key is
        # another installation's too (a database recreated beside the same Redis numbers keys
        # from 1 again), allowing for the clocks of the web hosts.
        key = keys.get(row.api_key_id) if row.api_key_id is not None else None  # (team id, created at)
        if row.team_id not in teams:
            dead.append((raw, UNKNOWN_TEAM))
        elif key is None or key[0] != row.team_id or row.created_at < key[1] - USAGE_CLOCK_SKEW:
            dead.append((raw, UNKNOWN_KEY))
        else:
            if row.deployment_id not in deployments:
                row.deployment_id = None  # a deployment deleted since: the row stays, unlinked
            rows.append((raw, row))
    closed = closed_days({_utc_day(row.created_at) for _raw, row in rows})
    if closed:
        dead.extend((raw, DAY_CLOSED) for raw, row in rows if _utc_day(row.created_at) in closed)
        rows = [(raw, row) for raw, row in rows if _utc_day(row.created_at) not in closed]
    try:
        with transaction.atomic():
            usage_insert([row for _raw, row in rows])
            _touch_last_used([row for _raw, row in rows])
        return len(rows), dead, _hours_of(row for _raw, row in rows)
    except _REFUSED_ERRORS:
        pass
    # One row PostgreSQL refuses (a token count over 2^31) must not stop the rest: row by row.
    stored = []
    for raw, row in rows:
        try:
            with transaction.atomic():
                Usage.objects.bulk_create([row], ignore_conflicts=True)
            stored.append(row)
        except _REFUSED_ERRORS as error:
            log.warning("usage record %s refused by the database: %s", row.request_id, error)
            dead.append((raw, REFUSED))
    with transaction.atomic():
        _touch_last_used(stored)
    return len(stored), dead, _hours_of(stored)


def _utc_day(when: dt.datetime) -> dt.date:
    return when.astimezone(dt.UTC).date()


def _hours_of(rows) -> set[int]:
    return {int(row.created_at.timestamp()) // 3600 * 3600 for row in rows}


# The columns the flush writes, in the table's terms (the id is the database's).
def _usage_columns() -> list:
    return [f for f in Usage._meta.concrete_fields if not f.primary_key]


def usage_insert(rows: list[Usage]) -> None:
    """Insert usage rows, skipping any whose (request_id, created_at) is already stored: a batch
    stored twice is stored once. On PostgreSQL through COPY into a temporary table and one
    INSERT ... ON CONFLICT DO NOTHING from it (perf/usage_insert_rate.py: several times
    bulk_create's rate); elsewhere bulk_create. Run inside the caller's transaction."""
    if not rows:
        return
    if connection.vendor != "postgresql":
        Usage.objects.bulk_create(rows, ignore_conflicts=True, batch_size=500)
        return
    fields = _usage_columns()
    quote = connection.ops.quote_name
    columns = ", ".join(quote(f.column) for f in fields)
    table = quote(Usage._meta.db_table)
    with connection.cursor() as cursor:
        # Columns typed like the table's (a value of the wrong type fails the COPY, before anything is
        # stored); emptied at each commit, kept for the connection's next batch.
        cursor.execute(
            f"CREATE TEMPORARY TABLE IF NOT EXISTS usage_incoming ON COMMIT DELETE ROWS AS "  # noqa: S608
            f"SELECT {columns} FROM {table} WITH NO DATA"
        )
        # The values as they are: psycopg adapts them, and PostgreSQL refuses what its column cannot
        # hold (the caller then retries row by row through the ORM, which says why). Django's own
        # per-field preparation was 40 % of the flush's time (perf/usage_insert_rate.py, cProfile).
        attnames = [f.attname for f in fields]
        with cursor.cursor.copy(f"COPY usage_incoming ({columns}) FROM STDIN") as copy:
            for row in rows:
                copy.write_row([getattr(row, name) for name in attnames])
        cursor.execute(
            f"INSERT INTO {table} ({columns}) SELECT {columns} FROM usage_incoming "  # noqa: S608
            "ON CONFLICT DO NOTHING"
        )


def _touch_last_used(rows: list[Usage]) -> None:
    last_used: dict[int, dt.datetime] = {}
    for row in rows:
        if row.api_key_id is not None:
            last_used[row.api_key_id] = max(last_used.get(row.api_key_id, row.created_at), row.created_at)
    for key_id, when in last_used.items():
        ApiKey.objects.filter(pk=key_id).filter(
            Q(last_used_at__isnull=True) | Q(last_used_at__lt=when)
        ).update(last_used_at=when)


@dataclass(frozen=True)
class DeadLetterReplay:
    replayed: int  # back on the queue
    kept_day_closed: int  # of days retention has closed: left dead-lettered


def usage_dead_letters_replay() -> DeadLetterReplay:
    """Put the dead-lettered usage records back on the queue (after fixing what refused them: a
    team or key restored, a column widened); the next flush stores each or dead-letters it again.
    Records of a day retention has closed stay dead-lettered: that day's rollups are final, so
    nothing would count them (`--purge` forgets them)."""
    client = gateway_redis()
    keys = redis_keys()
    replay = client.register_script(USAGE_REPLAY)
    call = UsageReplayCall(dead=keys.usage_dead, usage=keys.usage, kept_reason=DAY_CLOSED)
    replayed, kept = replay(keys=call.keys(), args=call.args())
    return DeadLetterReplay(replayed=int(replayed), kept_day_closed=int(kept))


def usage_dead_letters_purge() -> int:
    """Forget every dead-lettered usage record; returns how many there were."""
    client = gateway_redis()
    dead = redis_keys().usage_dead
    with client.pipeline(transaction=True) as pipe:
        pipe.llen(dead)
        pipe.delete(dead)
        count, _deleted = pipe.execute()
    return int(count)
