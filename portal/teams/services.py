"""Writes for teams: API keys (create, revoke), usage records (flush, daily rollup, budgets).

An API key is `sk-<prefix>.<secret>`. Only the prefix (to find the row) and an
HMAC-SHA256 of the whole key (to check it, in constant time) are stored; the
key is returned once by `api_key_create` and never again.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import json
import secrets
import uuid
from functools import cache

import redis
from django.conf import settings
from django.db import transaction
from django.db.models import Count, Q, Sum
from django.utils import timezone

from portal.audit.services import audit_event_record
from portal.core.errors import ApplicationError, clean_or_raise

from .models import ApiKey, Team, Usage, UsageDaily, UsageStatus

KEY_SCHEME = "sk-"
REDIS_PREFIX = "gw"


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
) -> tuple[ApiKey, str]:
    """Create a key; returns the row and the key itself, which is never shown again."""
    for field, value in [
        ("rpm_limit", rpm_limit),
        ("tpm_limit", tpm_limit),
        ("tokens_per_day", tokens_per_day),
        ("max_concurrent", max_concurrent),
    ]:
        if value is not None and value < 1:
            raise ApplicationError("Must be at least 1 (leave blank for no per-key limit).", field=field)
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
    )
    audit_event_record(
        action="api_key.create",
        target=key,
        actor=created_by,
        changes={"team": team.slug, "name": name, "allowed_models": models},
    )
    return key, token


@cache
def gateway_redis() -> redis.Redis:
    return redis.Redis.from_url(settings.GATEWAY_REDIS_URL)


def _block(kind: str, id: int, *, reason: str, until: dt.datetime | None = None) -> None:
    key = f"{REDIS_PREFIX}:blocked:{kind}:{id}"
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

# Where the gateway's RateLimiter (prefix "gw") queues usage records.
USAGE_LIST = f"{REDIS_PREFIX}:usage"


def _storable(text: object, limit: int) -> str:
    """Text PostgreSQL can hold: one record with a NUL or a lone surrogate must not fail a whole batch."""
    text = str(text or "").replace("\x00", "")
    return text.encode("utf-8", "replace").decode()[:limit]


def _usage_from_json(raw: bytes) -> Usage | None:
    try:
        data = json.loads(raw)
        return Usage(
            request_id=uuid.UUID(data["request_id"]),
            created_at=dt.datetime.fromtimestamp(data["created_at"], tz=dt.UTC),
            team_id=data["team_id"],
            api_key_id=data.get("api_key_id"),
            model=_storable(data.get("model"), 100),
            deployment_id=data.get("deployment_id"),
            endpoint=_storable(data.get("endpoint"), 30),
            stream=bool(data.get("stream")),
            status=data["status"],
            http_status=data["http_status"],
            error_code=_storable(data.get("error_code"), 50),
            prompt_tokens=max(0, int(data.get("prompt_tokens") or 0)),
            completion_tokens=max(0, int(data.get("completion_tokens") or 0)),
            ttft_ms=data.get("ttft_ms"),
            duration_ms=data.get("duration_ms") or 0.0,
        )
    except (KeyError, TypeError, ValueError):
        return None


def usage_flush(*, batch: int = 1000) -> int:
    """Move queued usage records from Redis into the database; returns how many were written.

    Read, insert, then trim: a crash between insert and trim re-reads the same records
    next time, and the unique request id makes the second insert a no-op, so each
    request still has exactly one row.
    """
    client = gateway_redis()
    total = 0
    while True:
        raws = client.lrange(USAGE_LIST, 0, batch - 1)
        if not raws:
            return total
        rows = [row for row in map(_usage_from_json, raws) if row is not None]
        known_keys = set(
            ApiKey.objects.filter(pk__in={r.api_key_id for r in rows}).values_list("pk", flat=True)
        )
        known_teams = set(Team.objects.filter(pk__in={r.team_id for r in rows}).values_list("pk", flat=True))
        rows = [r for r in rows if r.team_id in known_teams]
        for row in rows:
            if row.api_key_id not in known_keys:
                row.api_key_id = None
            if row.deployment_id is not None:
                row.deployment_id = _existing_deployment(row.deployment_id)
        with transaction.atomic():
            Usage.objects.bulk_create(rows, ignore_conflicts=True)
            last_used: dict[int, dt.datetime] = {}
            for row in rows:
                if row.api_key_id is not None:
                    last_used[row.api_key_id] = max(
                        last_used.get(row.api_key_id, row.created_at), row.created_at
                    )
            for key_id, when in last_used.items():
                ApiKey.objects.filter(pk=key_id).filter(
                    Q(last_used_at__isnull=True) | Q(last_used_at__lt=when)
                ).update(last_used_at=when)
        client.ltrim(USAGE_LIST, len(raws), -1)
        total += len(rows)


def _existing_deployment(deployment_id: int) -> int | None:
    from portal.deployments.models import Deployment

    return deployment_id if Deployment.objects.filter(pk=deployment_id).exists() else None


def usage_rollup(*, day: dt.date) -> int:
    """Recompute the daily rows of `day` from the usage records; returns how many rows."""
    start = dt.datetime.combine(day, dt.time.min, tzinfo=dt.UTC)
    groups = (
        Usage.objects.filter(created_at__gte=start, created_at__lt=start + dt.timedelta(days=1))
        .values("team_id", "api_key_id", "model")
        .annotate(
            requests=Count("id"),
            completed=Count("id", filter=Q(status=UsageStatus.COMPLETED)),
            rejected=Count("id", filter=Q(status=UsageStatus.REJECTED)),
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
            requests=g["requests"],
            completed=g["completed"],
            rejected=g["rejected"],
            failed=g["requests"] - g["completed"] - g["rejected"],
            prompt_tokens=g["prompt"] or 0,
            completion_tokens=g["completion"] or 0,
        )
        for g in groups
    ]
    with transaction.atomic():
        UsageDaily.objects.filter(day=day).delete()
        UsageDaily.objects.bulk_create(rows)
    return len(rows)


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


def team_in_flight(team: Team) -> int:
    """Requests of the team in flight now, from the gateway's concurrency set (0 if Redis is down)."""
    import time

    try:
        return gateway_redis().zcount(f"{REDIS_PREFIX}:conc:team:{team.pk}", int(time.time() * 1000), "+inf")
    except redis.RedisError:
        return 0
