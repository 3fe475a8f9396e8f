"""Step 1: who is calling. `Authorization: Bearer sk-<prefix>.<secret>` → a Caller.

Key rows are cached per process for GATEWAY_CACHE_S seconds (one database read per
key per interval, not per request). Revocation still takes effect at once: revoking
writes a block entry in Redis, which the admission script checks on every request.
The key is checked against its HMAC digest in constant time on every request; it is
never logged.

Failed authentications are counted per client address in Redis; past
GATEWAY_AUTH_FAILURES_PER_MINUTE, that address gets 429 for the rest of its minute
for any key this process does not already know to be good, without a database read.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import Error as DatabaseError
from django.db import close_old_connections
from redis.exceptions import RedisError

from portal.core.clientaddr import client_address
from portal.gateway.admission.limiter import RateLimiter
from portal.gateway.admission.records import Limits
from portal.teams.models import ApiKey, PriorityClass
from portal.teams.services import api_key_matches, api_key_prefix

from .cache import TtlCache
from .config import gateway_settings
from .errors import GatewayError, database_unavailable


@dataclass(frozen=True)
class Caller:
    key_id: int
    key_prefix: str
    team_id: int
    team_slug: str
    models: frozenset[str] | None  # None: any served model
    team_limits: Limits
    key_limits: Limits
    max_tokens_clamp: int
    digest: str
    revoked: bool
    expires_at: float | None  # epoch seconds
    disabled_until: float | None
    priority_class: str = PriorityClass.INTERACTIVE  # ApiKey.effective_priority_class
    pinned_deployment_id: int | None = None  # its requests go to this replica only (a benchmark key)

    @property
    def is_batch(self) -> bool:
        return self.priority_class == PriorityClass.BATCH


log = logging.getLogger("portal.gateway")

_cache = TtlCache(
    lambda: gateway_settings().cache_s, name="API keys", grace=lambda: gateway_settings().cache_grace_s
)
AUTH_FAILURE_WINDOW_S = 60.0


def _limits(row) -> Limits:
    return Limits(
        rpm=row.rpm_limit,
        tpm=row.tpm_limit,
        tokens_per_day=row.tokens_per_day,
        max_concurrent=row.max_concurrent,
    )


def _caller(key: ApiKey) -> Caller:
    team = key.team
    models = None
    if key.allowed_models and team.allowed_models:
        models = frozenset(key.allowed_models) & frozenset(team.allowed_models)
    elif key.allowed_models or team.allowed_models:
        models = frozenset(key.allowed_models or team.allowed_models)
    disabled = [d.timestamp() for d in (key.disabled_until, team.disabled_until) if d is not None]
    return Caller(
        key_id=key.pk,
        key_prefix=key.prefix,
        team_id=team.pk,
        team_slug=team.slug,
        models=models,
        team_limits=_limits(team),
        key_limits=_limits(key),
        max_tokens_clamp=team.max_tokens_clamp,
        digest=key.digest,
        revoked=key.revoked_at is not None,
        expires_at=key.expires_at.timestamp() if key.expires_at else None,
        disabled_until=max(disabled) if disabled else None,
        # Cached with the row (GATEWAY_CACHE_S), as every other key field: a change reaches each
        # process within one cache interval.
        priority_class=key.effective_priority_class(team),
        pinned_deployment_id=key.pinned_deployment_id,
    )


def _fetch(prefix: str) -> ApiKey | None:
    close_old_connections()  # the gateway handler sends no request signals (gateway/asgi.py)
    return ApiKey.objects.select_related("team").filter(prefix=prefix).first()


async def _load(prefix: str) -> Caller | None:
    async def load() -> Caller | None:
        key = await sync_to_async(_fetch)(prefix)
        return _caller(key) if key is not None else None

    return await _cache.get(prefix, load)


def _invalid() -> GatewayError:
    return GatewayError(401, "Incorrect API key provided.", code="invalid_api_key")


def _address(request) -> str:
    # One rule with the login throttle and the audit log (TRUSTED_PROXY_COUNT).
    return client_address(request) or "unknown"


async def _refuse_if_throttled(limiter: RateLimiter, address: str) -> None:
    try:
        failures, left_s = await limiter.auth_failures(address)
    except RedisError:
        return  # not a quota: admission refuses without Redis anyway
    if failures >= settings.GATEWAY_AUTH_FAILURES_PER_MINUTE:
        raise GatewayError(
            429,
            "Too many requests with an incorrect API key from this address; retry later.",
            code="too_many_auth_failures",
            retry_after=left_s or 1,
        )


async def _failed(limiter: RateLimiter, address: str) -> GatewayError:
    try:
        await limiter.count_auth_failure(address, window_s=AUTH_FAILURE_WINDOW_S)
    except RedisError:
        log.warning("failed authentication from %s not counted: Redis unavailable", address)
    return _invalid()


async def authenticate(request, limiter: RateLimiter) -> Caller:
    header = request.META.get("HTTP_AUTHORIZATION", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token:
        raise GatewayError(
            401, "Missing API key: send `Authorization: Bearer <key>`.", code="missing_api_key"
        )
    token = token.strip()
    prefix = api_key_prefix(token)
    if prefix is None:
        raise await _failed(limiter, _address(request))
    known = _cache.peek(prefix)
    good = known is not None and api_key_matches(token, known.digest)
    if not good:
        # Only a key not known good here can cost a database read: a flooding address waits.
        await _refuse_if_throttled(limiter, _address(request))
    try:
        caller = await _load(prefix)
    except DatabaseError:  # not cached here and PostgreSQL is down: a clear 503, not an HTML 500
        raise database_unavailable() from None
    # The digest is checked once per request: again only if the row is not the one checked above.
    if caller is None or not ((good and caller is known) or api_key_matches(token, caller.digest)):
        raise await _failed(limiter, _address(request))
    return caller


def ensure_usable(caller: Caller) -> None:
    """Refuse a known key that is revoked, expired or over its daily budget (these requests
    are billed to its team as rejected, unlike an unknown key)."""
    now = time.time()
    if caller.revoked:
        raise GatewayError(401, "This API key has been revoked.", code="revoked_api_key")
    if caller.expires_at is not None and caller.expires_at <= now:
        raise GatewayError(401, "This API key has expired.", code="expired_api_key")
    if caller.disabled_until is not None and caller.disabled_until > now:
        raise GatewayError(
            429,
            "The daily token budget is spent; requests resume at 00:00 UTC.",
            code="daily_budget_exceeded",
            retry_after=caller.disabled_until - now,
        )


async def ensure_not_blocked(caller: Caller, limiter: RateLimiter) -> None:
    """Refuse a key or team blocked in Redis (revoked, or its budget spent) at once, as the admission
    script does for completions: the cached row may not know yet. For requests that take no quota
    (`/v1/models`). Without Redis, no answer (the caller's `redis_required` makes it the 503): a revoked
    key must not read on while it is down."""
    team_block, key_block = await limiter.redis.mget(
        limiter.blocked_key("team", caller.team_id), limiter.blocked_key("key", caller.key_id)
    )
    if _says_revoked(key_block):
        raise GatewayError(401, "This API key has been revoked.", code="revoked_api_key")
    if key_block is not None or team_block is not None:
        status = 401 if key_block is not None else 403
        raise GatewayError(status, "This API key or its team is disabled.", code="key_disabled")


def _says_revoked(block: bytes | str | None) -> bool:
    """A block's value is its reason (portal/teams/services/blocks.py); revoking writes "revoked"."""
    return (block.decode() if isinstance(block, bytes) else block) == "revoked"


async def ensure_not_revoked(reason: str, caller: Caller, limiter: RateLimiter) -> None:
    """Admission refused the key as blocked (`reason` "key_blocked"): when the block is a revocation,
    say so ("revoked"), not "disabled", which reads as something that ends (issue 38). The cached
    key row does not know yet; the block's reason does."""
    if reason != "key_blocked":
        return
    if _says_revoked(await limiter.redis.get(limiter.blocked_key("key", caller.key_id))):
        raise GatewayError(401, "This API key has been revoked.", code="revoked_api_key")


def caller_for_key(key: ApiKey) -> Caller:
    """The caller of a key row the portal loaded itself (with its team), for a request it
    authenticated another way: the playground's session stands for the member's playground key."""
    return _caller(key)
