"""The portal's one synchronous Redis client (GATEWAY_REDIS_URL) and its key layout.

Pages, the metrics flush and scrape, revocation and the usage flush all use this client.
It has connect and read timeouts (GATEWAY_REDIS_TIMEOUT_S), so a hung Redis is an error
after one timeout, never a page or a worker that waits without end.
"""

from __future__ import annotations

from functools import cache

import redis
from django.conf import settings
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.retry import Retry

from inference.redis_keys import RedisKeys


@cache
def _client(url: str, timeout_s: float) -> redis.Redis:
    # As the gateway's client (docs/decisions.md, "Redis down"): only refused or broken
    # connections are retried, briefly; a timed-out script may already have run.
    return redis.Redis.from_url(
        url,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(
            ExponentialWithJitterBackoff(cap=0.1, base=0.01), 2, supported_errors=(RedisConnectionError,)
        ),
    )


def gateway_redis() -> redis.Redis:
    """The shared client (one connection pool per URL and timeout, so tests may change either)."""
    return _client(settings.GATEWAY_REDIS_URL, settings.GATEWAY_REDIS_TIMEOUT_S)


# Drops every pooled client (the pools are keyed by URL and timeout, so nothing needs it to see
# a changed setting; kept for callers of the former cached `teams.services.gateway_redis`).
gateway_redis.cache_clear = _client.cache_clear  # type: ignore[attr-defined]


@cache
def _keys(namespace: str) -> RedisKeys:
    return RedisKeys(namespace)


def redis_keys() -> RedisKeys:
    """This installation's keys (PORTAL_REDIS_NAMESPACE)."""
    return _keys(settings.PORTAL_REDIS_NAMESPACE)
