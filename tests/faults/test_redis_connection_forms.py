"""The one Redis client factory reaches Redis the ways a production setup needs: a Sentinel-watched
primary (REDIS_SENTINEL_MASTER, REDIS_SENTINELS), found again after a failover, and TLS
(`rediss://`, a managed Redis)."""

from __future__ import annotations

import asyncio
import signal
import subprocess

import pytest
import redis
from redis.connection import SSLConnection

from devtools import free_port, wait_until
from portal.core.redis import client as redis_client
from portal.gateway.admission.connection import ScriptConnection

from .conftest import REDIS_SERVER


@pytest.fixture
def sentinel(private_redis, tmp_path):
    """A Sentinel watching the private Redis as service `portal`."""
    port = free_port()
    conf = tmp_path / "sentinel.conf"
    conf.write_text(
        f"port {port}\nbind 127.0.0.1\nsentinel monitor portal 127.0.0.1 {private_redis.port} 1\n"
        "sentinel down-after-milliseconds portal 1000\nsentinel failover-timeout portal 5000\n"
    )
    process = subprocess.Popen(
        [REDIS_SERVER, str(conf), "--sentinel"], stdout=subprocess.DEVNULL, start_new_session=True
    )
    client = redis.Redis(port=port, socket_connect_timeout=0.5)

    def knows_the_primary() -> bool:
        try:
            return client.sentinel_get_master_addr_by_name("portal") is not None
        except redis.RedisError:
            return False

    wait_until(knows_the_primary, timeout_s=20, what="Sentinel watching the primary")
    yield port
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=10)


def test_the_clients_reach_the_primary_through_sentinel(private_redis, sentinel, settings):
    settings.REDIS_SENTINEL_MASTER = "portal"
    settings.REDIS_SENTINELS = [f"127.0.0.1:{sentinel}"]
    settings.GATEWAY_REDIS_URL = "redis://127.0.0.1:1/3"  # only its database counts: the host is Sentinel's
    redis_client.gateway_redis().set("through-sentinel", "sync")

    async def through_async() -> bytes:
        client = redis_client.async_gateway_redis()
        try:
            await client.set("through-sentinel-async", "async")
            return await client.get("through-sentinel")
        finally:
            await client.aclose()

    assert asyncio.run(through_async()) == b"sync"
    primary = redis.Redis(port=private_redis.port, db=3)
    assert primary.get("through-sentinel-async") == b"async"


def test_the_limiters_script_connection_reaches_the_primary_through_sentinel(
    private_redis, sentinel, settings
):
    settings.REDIS_SENTINEL_MASTER = "portal"
    settings.REDIS_SENTINELS = [f"127.0.0.1:{sentinel}"]
    settings.GATEWAY_REDIS_URL = "redis://127.0.0.1:1/3"

    async def through_scripts() -> bytes:
        client = redis_client.async_gateway_redis()
        scripts = ScriptConnection(client)  # opened by the client's Sentinel-managed connection class
        try:
            return await scripts.register_script("return redis.call('set', KEYS[1], ARGV[1])")(
                keys=["through-sentinel-script"], args=["script"]
            )
        finally:
            await scripts.aclose()
            await client.aclose()

    assert asyncio.run(through_scripts()) == b"OK"
    assert redis.Redis(port=private_redis.port, db=3).get("through-sentinel-script") == b"script"


def test_a_rediss_url_connects_with_tls(settings):
    settings.REDIS_SENTINEL_MASTER = ""
    settings.GATEWAY_REDIS_URL = "rediss://:secret@redis.example:6380/2?ssl_cert_reqs=required"
    client = redis_client.make_redis()
    pool = client.connection_pool
    assert pool.connection_class is SSLConnection
    assert (pool.connection_kwargs["host"], pool.connection_kwargs["db"]) == ("redis.example", 2)
    assert pool.connection_kwargs["socket_timeout"] == settings.GATEWAY_REDIS_TIMEOUT_S
