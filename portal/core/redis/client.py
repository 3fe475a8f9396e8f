"""The portal's one Redis client factory (GATEWAY_REDIS_URL, or a Sentinel-watched primary) and
its key layout.

Pages, the metrics flush and scrape, revocation and the usage flush use the synchronous client;
the gateway's event loops use `async_gateway_redis`. Both have connect and read timeouts
(GATEWAY_REDIS_TIMEOUT_S), so a hung Redis is an error after one timeout, never a page or a worker
that waits without end; and both reach Redis the same way:

- `redis://[:password@]host:port/db`, or `rediss://...` for TLS (a managed Redis), with redis-py's
  query options (`?ssl_cert_reqs=required&ssl_ca_certs=/path/ca.pem`);
- with `REDIS_SENTINEL_MASTER` set, the primary that the Sentinels in `REDIS_SENTINELS`
  (`host:port,host:port`) name for that service, found again after a failover; the URL then
  gives only the database, password and TLS (docs/scale.md, "Redis: persistence and failover").
"""

from __future__ import annotations

from functools import cache

import redis
import redis.asyncio
import redis.asyncio.sentinel
import redis.sentinel
from django.conf import settings
from redis.backoff import ExponentialWithJitterBackoff
from redis.connection import parse_url
from redis.exceptions import ConnectionError as RedisConnectionError

from .keys import RedisKeys


def _retry(asynchronous: bool):
    # The one retry policy of every client (docs/decisions.md, "Redis down"): only refused or
    # broken connections are retried, briefly; a timed-out script may already have run.
    from redis.asyncio.retry import Retry as AsyncRetry
    from redis.retry import Retry

    cls = AsyncRetry if asynchronous else Retry
    return cls(ExponentialWithJitterBackoff(cap=0.1, base=0.01), 2, supported_errors=(RedisConnectionError,))


def _sentinel_master(
    url: str, timeout_s: float, sentinels: tuple[str, ...], master: str, *, asynchronous: bool
):
    parsed = parse_url(url)
    tls = parsed.pop("connection_class", None) is not None and url.startswith("rediss://")
    parsed.pop("host", None)
    parsed.pop("port", None)
    kwargs = {
        **parsed,
        "socket_timeout": timeout_s,
        "socket_connect_timeout": timeout_s,
        "retry": _retry(asynchronous),
    }
    if tls:
        kwargs["ssl"] = True
    addresses = [(host, int(port)) for host, _, port in (s.rpartition(":") for s in sentinels)]
    module = redis.asyncio.sentinel if asynchronous else redis.sentinel
    sentinel = module.Sentinel(
        addresses,
        sentinel_kwargs={"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s},
        socket_timeout=timeout_s,
    )
    return sentinel.master_for(
        master, redis_class=redis.asyncio.Redis if asynchronous else redis.Redis, **kwargs
    )


def make_redis(*, asynchronous: bool = False):
    """A new client (its own connection pool) from the settings: plain URL, TLS URL or Sentinel."""
    url, timeout = settings.GATEWAY_REDIS_URL, settings.GATEWAY_REDIS_TIMEOUT_S
    if settings.REDIS_SENTINEL_MASTER:
        return _sentinel_master(
            url,
            timeout,
            tuple(settings.REDIS_SENTINELS),
            settings.REDIS_SENTINEL_MASTER,
            asynchronous=asynchronous,
        )
    cls = redis.asyncio.Redis if asynchronous else redis.Redis
    return cls.from_url(
        url, socket_timeout=timeout, socket_connect_timeout=timeout, retry=_retry(asynchronous)
    )


@cache
def _client(url: str, timeout_s: float, sentinels: tuple[str, ...], master: str) -> redis.Redis:
    return make_redis()


def gateway_redis() -> redis.Redis:
    """The shared client (one connection pool per URL, timeout and Sentinel setting, so tests may
    change any of them)."""
    return _client(
        settings.GATEWAY_REDIS_URL,
        settings.GATEWAY_REDIS_TIMEOUT_S,
        tuple(settings.REDIS_SENTINELS),
        settings.REDIS_SENTINEL_MASTER,
    )


def async_gateway_redis() -> redis.asyncio.Redis:
    """A new asyncio client, for one event loop (the gateway keeps one per loop)."""
    return make_redis(asynchronous=True)


@cache
def _keys(namespace: str) -> RedisKeys:
    return RedisKeys(namespace)


def redis_keys() -> RedisKeys:
    """This installation's keys (PORTAL_REDIS_NAMESPACE)."""
    return _keys(settings.PORTAL_REDIS_NAMESPACE)
