"""The rate limiter's own Redis connection (portal/gateway/admission/connection.py): many calls share one
pipelined connection, each gets its own reply, and the client's failure policy holds: a hung
Redis is a timeout, a refused or broken connection is retried, a restarted Redis (its scripts
gone) is reconnected to and sent the scripts again."""

from __future__ import annotations

import asyncio
import signal

import pytest
from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from devtools import free_port
from portal.gateway.admission.connection import ScriptConnection
from tests.helpers.processes import run_async

ECHO = "return {ARGV[1], redis.call('incr', KEYS[1])}"
FAILS = "return redis.error_reply('refused by the script')"


def client_of(port: int, *, timeout_s: float = 2.0) -> Redis:
    # The portal's policy (portal/core/redis/client.py): only connection errors are retried.
    retry = Retry(NoBackoff(), 2, supported_errors=(RedisConnectionError,))
    return Redis(port=port, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=retry)


async def connections(client: Redis) -> int:
    return int((await client.info("clients"))["connected_clients"])


def test_concurrent_calls_share_one_connection_and_each_gets_its_own_reply(private_redis):
    async def go():
        client = client_of(private_redis.port)
        scripts = ScriptConnection(client)
        echo = scripts.register_script(ECHO)
        before = await connections(client)
        replies = await asyncio.gather(*[echo(keys=["n"], args=[f"call-{i}"]) for i in range(50)])
        opened = await connections(client) - before
        await scripts.aclose()
        await client.aclose()
        return replies, opened

    replies, opened = run_async(go())
    assert [r[0] for r in replies] == [f"call-{i}".encode() for i in range(50)]
    assert sorted(r[1] for r in replies) == list(range(1, 51))  # each ran once
    assert opened == 1


def test_a_script_error_reaches_its_caller_and_the_connection_stays_usable(private_redis):
    async def go():
        client = client_of(private_redis.port)
        scripts = ScriptConnection(client)
        fails, echo = scripts.register_script(FAILS), scripts.register_script(ECHO)
        with pytest.raises(ResponseError, match="refused by the script"):
            await fails()
        after = await echo(keys=["n"], args=["next"])
        await scripts.aclose()
        await client.aclose()
        return after

    assert run_async(go()) == [b"next", 1]


def test_a_cancelled_call_leaves_the_next_caller_its_own_reply(private_redis):
    async def go():
        client = client_of(private_redis.port)
        scripts = ScriptConnection(client)
        echo = scripts.register_script(ECHO)
        await echo(keys=["n"], args=["warm"])  # connected
        first = asyncio.create_task(echo(keys=["n"], args=["cancelled"]))
        await asyncio.sleep(0)  # its command is written; its reply not read yet
        first.cancel()
        second = await echo(keys=["n"], args=["second"])
        await scripts.aclose()
        await client.aclose()
        return first.cancelled(), second

    cancelled, second = run_async(go())
    assert cancelled
    assert second[0] == b"second"


def test_a_hung_redis_is_a_timeout_then_a_new_connection_once_it_answers(private_redis):
    async def go():
        client = client_of(private_redis.port, timeout_s=0.3)
        scripts = ScriptConnection(client)
        echo = scripts.register_script(ECHO)
        await echo(keys=["n"], args=["before"])
        private_redis.kill(signal.SIGSTOP)
        try:
            with pytest.raises(RedisTimeoutError):
                await echo(keys=["n"], args=["hung"])
        finally:
            private_redis.kill(signal.SIGCONT)
        after = await echo(keys=["n"], args=["after"])
        await scripts.aclose()
        await client.aclose()
        return after

    after = run_async(go())
    # The hung call's script ran once Redis went on (a timeout never retries: it may have run).
    assert after[0] == b"after" and after[1] in (2, 3)


def test_a_restarted_redis_is_reconnected_to_and_sent_the_script_again(private_redis):
    async def go():
        client = client_of(private_redis.port)
        scripts = ScriptConnection(client)
        echo = scripts.register_script(ECHO)
        await echo(keys=["n"], args=["before"])
        private_redis.kill(signal.SIGKILL)
        private_redis.start()  # no persistence: every key and script is gone
        after = await echo(keys=["n"], args=["after"])  # the broken connection is retried
        await scripts.aclose()
        await client.aclose()
        return after

    assert run_async(go()) == [b"after", 1]


def test_a_refused_connection_is_a_connection_error_after_the_retries():
    async def go():
        client = client_of(free_port())  # nothing listens there
        scripts = ScriptConnection(client)
        with pytest.raises(RedisConnectionError):
            await scripts.register_script(ECHO)(keys=["n"], args=["x"])
        await client.aclose()

    run_async(go())
