"""The gateway's block list: a team or key refused at admission, in every web process at once.

Written by the services that disable something (a revoked key, a spent daily budget); the
gateway's admission script reads it (`RedisKeys.blocked`)."""

from __future__ import annotations

import datetime as dt

from portal.core.redis.client import gateway_redis, redis_keys


def gateway_block(kind: str, id: int, *, reason: str, until: dt.datetime | None = None) -> None:
    """Block the team or key (`kind` "team" or "key") for good, or until `until`."""
    key = redis_keys().blocked(kind, id)
    if until is None:
        gateway_redis().set(key, reason)
    else:
        gateway_redis().set(key, reason, pxat=int(until.timestamp() * 1000))
