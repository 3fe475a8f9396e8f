"""Writes for teams: API keys (create, revoke), usage records (flush, daily rollup, budgets).

An API key is `sk-<prefix>.<secret>`. Only the prefix (to find the row) and an
HMAC-SHA256 of the whole key (to check it, in constant time) are stored; the
key is returned once by `api_key_create` and never again.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import hmac
import json
import logging
import secrets
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from functools import cache

import redis
from django.conf import settings
from django.db import DataError, IntegrityError, connection, transaction
from django.db.models import Count, Q, Sum
from django.db.models.functions import TruncHour
from django.utils import timezone

from inference.redis_keys import USAGE_DEAD_LETTERS, RedisKeys
from portal.audit.services import audit_event_record
from portal.core.errors import ApplicationError, clean_or_raise
from portal.core.redis_client import gateway_redis, redis_keys

from . import partitions
from .models import (
    BIGINT_MAX,
    INT_MAX,
    ApiKey,
    PriorityClass,
    Team,
    Usage,
    UsageDaily,
    UsageHourly,
    UsageStatus,
)
from .usage_record import UnreadableUsageRecord, UsageRecord

KEY_SCHEME = "sk-"
log = logging.getLogger("portal.teams")


def api_key_hmac_secret() -> bytes:
    """GATEWAY_KEY_HMAC_SECRET, or a key derived from SECRET_KEY for this one purpose."""
    return _hmac_secret(settings.GATEWAY_KEY_HMAC_SECRET, settings.SECRET_KEY)


@cache
def _hmac_secret(explicit: str, secret_key: str) -> bytes:
    if explicit:
        return explicit.encode()
    return hmac.new(secret_key.encode(), b"portal.teams.api-key-digest", hashlib.sha256).digest()


def api_key_digest(token: str) -> str:
    return hmac.new(api_key_hmac_secret(), token.encode(), hashlib.sha256).hexdigest()


def api_key_prefix(token: str) -> str | None:
    """The prefix of a well-formed key, else None (nothing about the rest is revealed)."""
    if not token.startswith(KEY_SCHEME) or "." not in token or len(token) > 200:
        return None
    prefix = token[len(KEY_SCHEME) :].split(".", 1)[0]
    return prefix if 0 < len(prefix) <= 16 else None


def api_key_matches(token: str, digest: str) -> bool:
    return hmac.compare_digest(api_key_digest(token), digest)


@transaction.atomic
def team_create(*, slug: str, name: str = "", gpu_quota: int = 0) -> Team:
    """A new team (`manage.py create_team`); its name defaults to the slug."""
    team = Team(slug=slug, name=name or slug, gpu_quota=gpu_quota)
    clean_or_raise(team)
    team.save()
    audit_event_record(action="team.create", target=team, changes={"slug": slug, "gpu_quota": gpu_quota})
    return team


def _clean_models(models: list[str] | None) -> list[str]:
    return sorted({m.strip() for m in (models or []) if m.strip()})


def api_key_create(
    *,
    team: Team,
    name: str = "",
    allowed_models: list[str] | None = None,
    expires_at: dt.datetime | None = None,
    created_by=None,
    rpm_limit: int | None = None,
    tpm_limit: int | None = None,
    tokens_per_day: int | None = None,
    max_concurrent: int | None = None,
    priority_class: str = "",
) -> tuple[ApiKey, str]:
    """Create a key; returns the row and the key itself, which is never shown again.

    `priority_class` blank: the team's. A member may make a key batch (it only gives capacity
    up), but only staff (or a shell command, `created_by` None) may make a batch team's key
    interactive: that would undo the class ops gave the team. A member's interactive key of an
    interactive team follows the team down if staff later make it batch
    (`ApiKey.effective_priority_class`); a class staff set holds."""
    if priority_class not in ("", *PriorityClass.values):
        raise ApplicationError(
            f"Must be one of {', '.join(PriorityClass.values)} (blank: the team's class).",
            field="priority_class",
        )
    if (
        priority_class == PriorityClass.INTERACTIVE
        and team.priority_class == PriorityClass.BATCH
        and created_by is not None
        and not created_by.is_staff
    ):
        raise ApplicationError(
            "The team is in the batch class; only staff may give one of its keys the interactive class.",
            field="priority_class",
        )
    for field, value, most in [
        ("rpm_limit", rpm_limit, INT_MAX),
        ("tpm_limit", tpm_limit, INT_MAX),
        ("tokens_per_day", tokens_per_day, BIGINT_MAX),
        ("max_concurrent", max_concurrent, INT_MAX),
    ]:
        if value is not None and value < 1:
            raise ApplicationError("Must be at least 1 (leave blank for no per-key limit).", field=field)
        if value is not None and value > most:
            raise ApplicationError(f"Must be at most {most}.", field=field)
    if expires_at is not None and expires_at <= timezone.now():
        raise ApplicationError("The expiry is in the past.", field="expires_at")
    models = _clean_models(allowed_models)
    if team.allowed_models:
        outside = sorted(set(models) - set(team.allowed_models))
        if outside:
            raise ApplicationError(f"The team may not use {', '.join(outside)}.", field="allowed_models")
    prefix = secrets.token_hex(6)
    token = f"{KEY_SCHEME}{prefix}.{secrets.token_urlsafe(32)}"
    key = ApiKey.objects.create(
        team=team,
        name=name,
        prefix=prefix,
        digest=api_key_digest(token),
        allowed_models=models,
        expires_at=expires_at,
        created_by=created_by,
        rpm_limit=rpm_limit,
        tpm_limit=tpm_limit,
        tokens_per_day=tokens_per_day,
        max_concurrent=max_concurrent,
        priority_class=priority_class,
        priority_class_set_by_staff=bool(priority_class) and (created_by is None or created_by.is_staff),
    )
    audit_event_record(
        action="api_key.create",
        target=key,
        actor=created_by,
        changes={"team": team.slug, "name": name, "allowed_models": models, "priority_class": priority_class},
    )
    return key, token


def member_key_for(*, team: Team, user, purpose: str) -> ApiKey:
    """The member's hidden key of `team` for `purpose` ("playground" or "benchmark"), with its team
    loaded, made on first use: one key per (team, member, purpose), named "<purpose> (<user>)" so
    usage says whose it is. Its first secret is dropped at once (nothing holds it).

    Claimed by a conditional UPDATE: a second first use racing this one hits the unique constraint
    on `<purpose>_user` and takes the winner's key instead."""
    owner_field = {"playground": "playground_user", "benchmark": "benchmark_user"}[purpose]
    keys = ApiKey.objects.select_related("team").filter(team=team)
    found = keys.filter(**{owner_field: user}).first()
    if found is not None:
        return found
    try:
        with transaction.atomic():
            name = f"{purpose} ({user.get_username()})"[:100]
            key, _discarded = api_key_create(team=team, name=name, created_by=user)
            ApiKey.objects.filter(pk=key.pk, **{f"{owner_field}__isnull": True}).update(**{owner_field: user})
    except IntegrityError:
        pass
    return keys.get(**{owner_field: user})


def api_key_new_secret(
    *, api_key: ApiKey, allowed_models: list[str] | None = None, pinned_deployment_id: int | None = None
) -> str:
    """A new prefix and secret for a key the portal itself holds (a member's benchmark key), its
    models and pinned deployment set with them; returns the key, which exists nowhere else.

    The old secret stops working in every web process within GATEWAY_CACHE_S: the gateway caches
    key rows by prefix, and the old prefix no longer finds a row. A revoked key stays revoked."""
    prefix = secrets.token_hex(6)
    token = f"{KEY_SCHEME}{prefix}.{secrets.token_urlsafe(32)}"
    ApiKey.objects.filter(pk=api_key.pk).update(
        prefix=prefix,
        digest=api_key_digest(token),
        allowed_models=_clean_models(allowed_models),
        pinned_deployment_id=pinned_deployment_id,
    )
    api_key.refresh_from_db()
    return token


def _block(kind: str, id: int, *, reason: str, until: dt.datetime | None = None) -> None:
    key = redis_keys().blocked(kind, id)
    if until is None:
        gateway_redis().set(key, reason)
    else:
        gateway_redis().set(key, reason, pxat=int(until.timestamp() * 1000))


def api_key_revoke(*, api_key: ApiKey) -> bool:
    """Revoke a key for good. Takes effect on the next request in every web process: the
    gateway checks Redis's block list inside its admission script. False if already revoked."""
    updated = ApiKey.objects.filter(pk=api_key.pk, revoked_at__isnull=True).update(revoked_at=timezone.now())
    if updated:
        transaction.on_commit(lambda: _block("key", api_key.pk, reason="revoked"))
        audit_event_record(action="api_key.revoke", target=api_key, changes={"team": api_key.team.slug})
    return bool(updated)


# --- usage ---------------------------------------------------------------------------

# How long a flusher may hold a batch it took before another flusher puts it back on the
# queue (a worker that died mid-batch). A batch of 1000 takes well under a second to store;
# a batch stored twice is harmless (one row per request id).
USAGE_BATCH_LEASE_MS = 120_000
# How far a web host's clock (a record's created_at) may lag the database's (a key's created_at).
USAGE_CLOCK_SKEW = dt.timedelta(minutes=5)
# The dead-letter list keeps the newest this many records (a flood of foreign records must
# not fill Redis); every one is counted in /metrics whether or not it is kept.
USAGE_DEAD_MAX = 100_000

# KEYS: usage list, flushers zset, this batch's list; ARGV: batch size, lease ms, flusher id.
# Moves up to `batch` records from the queue to the flusher's own list in one step, so two
# flushers never take the same records, and a dead flusher's batch can be put back.
_USAGE_TAKE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local raws = redis.call('LRANGE', KEYS[1], 0, tonumber(ARGV[1]) - 1)
if #raws == 0 then return raws end
redis.call('LTRIM', KEYS[1], #raws, -1)
for i = 1, #raws, 500 do
  redis.call('RPUSH', KEYS[3], unpack(raws, i, math.min(i + 499, #raws)))
end
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[2]), ARGV[3])
return raws
"""

# KEYS: usage list, flushers zset, the batch's list; ARGV: flusher id, '1' = even if its lease runs.
# Puts a batch back on the queue: its flusher's lease ran out (it died), or it gave up on it.
_USAGE_GIVE_BACK = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lease_end = redis.call('ZSCORE', KEYS[2], ARGV[1])
if ARGV[2] ~= '1' and lease_end and tonumber(lease_end) > now then return 0 end
local raws = redis.call('LRANGE', KEYS[3], 0, -1)
for i = 1, #raws, 500 do
  redis.call('RPUSH', KEYS[1], unpack(raws, i, math.min(i + 499, #raws)))
end
redis.call('DEL', KEYS[3])
redis.call('ZREM', KEYS[2], ARGV[1])
return #raws
"""


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


def _storable(text: object, limit: int) -> str:
    """Text PostgreSQL can hold: one record with a NUL or a lone surrogate must not fail a whole batch."""
    text = str(text or "").replace("\x00", "")
    return text.encode("utf-8", "replace").decode()[:limit]


def _usage_row(record: UsageRecord) -> Usage:
    """The row of a record, its text cut to what the columns hold."""
    return Usage(
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
    take = client.register_script(_USAGE_TAKE)
    give_back = client.register_script(_USAGE_GIVE_BACK)
    _usage_requeue_abandoned(client, keys, give_back)
    total = 0
    while True:
        flusher = uuid.uuid4().hex
        taken = keys.usage_taken(flusher)
        raws = take(
            keys=[keys.usage, keys.usage_flushers, taken], args=[batch, USAGE_BATCH_LEASE_MS, flusher]
        )
        if not raws:
            return total
        try:
            stored, dead, hours = _usage_store(raws)
        except BaseException:
            # The database is down or the worker is stopping: the batch goes back to the queue now
            # rather than after its lease (the failure is still raised).
            with contextlib.suppress(redis.RedisError):
                give_back(keys=[keys.usage, keys.usage_flushers, taken], args=[flusher, "1"])
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


def _dead_entry(raw: bytes, reason: str, at: float) -> str:
    return json.dumps({"reason": reason, "at": at, "record": raw.decode("utf-8", "replace")})


def _usage_requeue_abandoned(client: redis.Redis, keys: RedisKeys, give_back) -> None:
    """Put back on the queue each batch whose flusher's lease ran out (it died before storing it).
    The script judges the lease by Redis's clock; the set holds one member per running flusher."""
    for flusher in client.zrange(keys.usage_flushers, 0, -1):
        flusher = flusher.decode()
        n = give_back(keys=[keys.usage, keys.usage_flushers, keys.usage_taken(flusher)], args=[flusher, "0"])
        if n:
            log.warning("usage flush: %d record(s) of an abandoned batch put back on the queue", n)


def _usage_store(raws: list[bytes]) -> tuple[int, list[tuple[bytes, str]], set[int]]:
    """Insert a batch; returns (rows stored, [(raw record, why not)] for the rest, the UTC hours
    (epoch seconds) of the rows stored, for the hourly rollup)."""
    dead: list[tuple[bytes, str]] = []
    parsed: list[tuple[bytes, Usage]] = []
    for raw in raws:
        try:
            parsed.append((raw, _usage_row(UsageRecord.from_json(raw))))
        except UnreadableUsageRecord:
            dead.append((raw, UNREADABLE))
    teams = set(Team.objects.filter(pk__in={r.team_id for _, r in parsed}).values_list("pk", flat=True))
    keys = {
        pk: (team_id, created_at)
        for pk, team_id, created_at in ApiKey.objects.filter(
            pk__in={r.api_key_id for _, r in parsed if isinstance(r.api_key_id, int)}
        ).values_list("pk", "team_id", "created_at")
    }
    deployments = _existing_deployments(
        {r.deployment_id for _, r in parsed if isinstance(r.deployment_id, int)}
    )
    rows: list[tuple[bytes, Usage]] = []
    for raw, row in parsed:
        # Records of another installation (a shared Redis) or of a team deleted since: refused,
        # not stored under a stranger's id or without a key. A record older than its key is
        # another installation's too (a database recreated beside the same Redis numbers keys
        # from 1 again), allowing for the clocks of the web hosts.
        team_id, key_created = keys.get(row.api_key_id, (None, None))
        if row.team_id not in teams:
            dead.append((raw, UNKNOWN_TEAM))
        elif team_id != row.team_id or row.created_at < key_created - USAGE_CLOCK_SKEW:
            dead.append((raw, UNKNOWN_KEY))
        else:
            if row.deployment_id not in deployments:
                row.deployment_id = None  # a deployment deleted since: the row stays, unlinked
            rows.append((raw, row))
    closed = _closed_days({_utc_day(row.created_at) for _raw, row in rows})
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


def _existing_deployments(ids: set[int]) -> set[int]:
    # Through the foreign key's model: teams sits below deployments and does not import it.
    deployments = Usage._meta.get_field("deployment").related_model._default_manager
    return set(deployments.filter(pk__in=ids).values_list("pk", flat=True)) if ids else set()


# KEYS: dead-letter list, usage list; ARGV: the reason that stays. In one step, moves every
# dead-lettered record back to the queue except those of that reason, which stay dead-lettered.
_USAGE_REPLAY = """
local entries = redis.call('LRANGE', KEYS[1], 0, -1)
local kept = {}
for _, entry in ipairs(entries) do
  local decoded = cjson.decode(entry)
  if decoded['reason'] == ARGV[1] then
    table.insert(kept, entry)
  else
    redis.call('RPUSH', KEYS[2], decoded['record'])
  end
end
redis.call('DEL', KEYS[1])
for i = 1, #kept, 500 do
  redis.call('RPUSH', KEYS[1], unpack(kept, i, math.min(i + 499, #kept)))
end
return {#entries - #kept, #kept}
"""


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
    replay = client.register_script(_USAGE_REPLAY)
    replayed, kept = replay(keys=[keys.usage_dead, keys.usage], args=[DAY_CLOSED])
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


def _day_start(day: dt.date) -> dt.datetime:
    return dt.datetime.combine(day, dt.time.min, tzinfo=dt.UTC)


def _closed_days(days: set[dt.date]) -> set[dt.date]:
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
            prompt=Sum("prompt_tokens"),
            completion=Sum("completion_tokens"),
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
            failed=g["requests"] - g["completed"] - g["rejected"],
            prompt_tokens=g["prompt"] or 0,
            completion_tokens=g["completion"] or 0,
        )
        for g in groups
    ]
    days = {since.date() + dt.timedelta(days=n) for n in range((until - since).days + 2)}
    closed = _closed_days(days)
    rows = [row for row in rows if row.hour.astimezone(dt.UTC).date() not in closed]
    with transaction.atomic():
        stale = UsageHourly.objects.filter(hour__gte=since, hour__lt=until)
        for day in closed:
            stale = stale.exclude(hour__gte=_day_start(day), hour__lt=_day_start(day + dt.timedelta(days=1)))
        stale.delete()
        UsageHourly.objects.bulk_create(rows, batch_size=1000)
    return len(rows)


def usage_rollup_daily(*, day: dt.date) -> int:
    """Recompute the daily rows of `day` by summing its hourly rows; returns how many rows.
    A closed day keeps its rows as they are."""
    if UsageDaily.objects.filter(day=day, closed=True).exists():
        return UsageDaily.objects.filter(day=day).count()
    groups = (
        UsageHourly.objects.filter(hour__gte=_day_start(day), hour__lt=_day_start(day + dt.timedelta(days=1)))
        .order_by()
        .values("team_id", "api_key_id", "model", "priority_class")
        .annotate(
            n=Sum("requests"),
            ok=Sum("completed"),
            refused=Sum("rejected"),
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
        usage_rollup_hours(since=_day_start(day), until=_day_start(day + dt.timedelta(days=1)))
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
    cutoff = _day_start(before)
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
        start = _day_start(day)
        records = Usage.objects.filter(created_at__gte=start, created_at__lt=start + dt.timedelta(days=1))
        deleted += delete_in_batches(records, batch_size=batch_size)


def budgets_enforce(*, day: dt.date) -> list[str]:
    """Disable, until the next UTC midnight, every team and key whose tokens on `day` reached
    its daily budget (a backstop: the admission script already refuses requests over it).
    Returns what was disabled, e.g. ["team search", "key sk-ab12…"]."""
    until = dt.datetime.combine(day + dt.timedelta(days=1), dt.time.min, tzinfo=dt.UTC)
    if until <= timezone.now():
        return []
    done = []
    totals = UsageDaily.objects.filter(day=day)
    per_team = totals.values("team_id").annotate(t=Sum("prompt_tokens") + Sum("completion_tokens"))
    per_key = (
        totals.exclude(api_key=None)
        .values("api_key_id")
        .annotate(t=Sum("prompt_tokens") + Sum("completion_tokens"))
    )
    for row in per_team:
        team = Team.objects.get(pk=row["team_id"])
        if team.tokens_per_day and row["t"] >= team.tokens_per_day and not team.is_disabled():
            reason = f"daily budget of {team.tokens_per_day} tokens spent on {day}"
            Team.objects.filter(pk=team.pk).update(disabled_until=until, disabled_reason=reason)
            transaction.on_commit(lambda pk=team.pk, r=reason: _block("team", pk, reason=r, until=until))
            done.append(f"team {team.slug}")
    for row in per_key:
        key = ApiKey.objects.get(pk=row["api_key_id"])
        if key.tokens_per_day and row["t"] >= key.tokens_per_day and not key.is_disabled():
            reason = f"daily budget of {key.tokens_per_day} tokens spent on {day}"
            ApiKey.objects.filter(pk=key.pk).update(disabled_until=until, disabled_reason=reason)
            transaction.on_commit(lambda pk=key.pk, r=reason: _block("key", pk, reason=r, until=until))
            done.append(f"key {key}")
    return done


def team_in_flight(team: Team) -> int | None:
    """Requests of the team in flight now, from the gateway's concurrency set (None if Redis is
    down or hung: the client's timeout bounds the wait)."""
    try:
        now_ms = int(time.time() * 1000)
        return gateway_redis().zcount(redis_keys().concurrency("team", team.pk), now_ms, "+inf")
    except redis.RedisError:
        return None
