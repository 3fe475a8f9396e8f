"""The portal's one synchronous Redis client (GATEWAY_REDIS_URL) and its key layout.

Pages, the metrics flush and scrape, revocation and the usage flush all use this client.
It has connect and read timeouts (GATEWAY_REDIS_TIMEOUT_S), so a hung Redis is an error
after one timeout, never a page or a worker that waits without end.
"""

from __future__ import annotations

from functools import cache

import redis
from django.conf import settings

from inference.redis_keys import RedisKeys


@cache
def _client(url: str, timeout_s: float) -> redis.Redis:
    return redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)


def gateway_redis() -> redis.Redis:
    """The shared client (one connection pool per URL and timeout, so tests may change either)."""
    return _client(settings.GATEWAY_REDIS_URL, settings.GATEWAY_REDIS_TIMEOUT_S)


@cache
def _keys(namespace: str) -> RedisKeys:
    return RedisKeys(namespace)


def redis_keys() -> RedisKeys:
    """This installation's keys (PORTAL_REDIS_NAMESPACE)."""
    return _keys(settings.PORTAL_REDIS_NAMESPACE)
