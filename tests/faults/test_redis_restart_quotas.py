"""A Redis restart (without persistence: every key lost) neither hands out a fresh daily budget
nor forgets the streams in flight: a missing daily counter is rebuilt from the usage records in
the database before anything is admitted against it, and the web process puts back the slots of
the streams it still serves at its next renewal."""

from __future__ import annotations

import asyncio
import signal
import time

import httpx
import pytest

from devtools import stop, wait_until
from portal.core.redis.client import redis_keys
from tests.helpers.gateway import chat_body, make_setup, upstream_reset, upstream_stats
from tests.helpers.processes import run_async

from .conftest import shared_database_url, start_web

pytestmark = [pytest.mark.faults]


def restart(private_redis) -> None:
    private_redis.kill(signal.SIGKILL)
    private_redis.start()


def web_env(private_redis, **extra: str) -> dict[str, str]:
    return {
        "DATABASE_URL": shared_database_url(),
        "REDIS_URL": private_redis.url,
        "GATEWAY_REDIS_URL": private_redis.url,
        **extra,
    }


def test_a_redis_restart_does_not_hand_out_a_fresh_daily_budget(
    transactional_db, team, cpu_node, fake_upstream, private_redis, tmp_path, settings
):
    from portal.teams.services import usage_flush

    settings.GATEWAY_REDIS_URL = private_redis.url  # the flush below drains the private Redis
    setup = make_setup(team=team, node=cpu_node, upstream=fake_upstream, key_kwargs={"tokens_per_day": 40})
    web = start_web(tmp_path / "web.log", web_env(private_redis))
    body = chat_body(setup.model, "Hi", max_tokens=4)
    try:
        statuses = []
        while not statuses or statuses[-1] == 200:
            assert len(statuses) < 40, statuses
            statuses.append(
                httpx.post(f"{web.url}/v1/chat/completions", headers=setup.headers, json=body).status_code
            )
        assert statuses[-1] == 429 and len(statuses) > 1, statuses
        # The day's usage reaches the database (the beat's flush), then Redis restarts empty.
        queued = private_redis.client()
        wait_until(
            lambda: usage_flush() == 0 and not queued.llen(redis_keys().usage), timeout_s=30, what="flushed"
        )
        restart(private_redis)
        after = httpx.post(f"{web.url}/v1/chat/completions", headers=setup.headers, json=body, timeout=30)
    finally:
        stop(web.process)
    assert after.status_code == 429, after.text
    assert "tokens per day" in after.json()["error"]["message"]


def test_streams_in_flight_re_register_their_slots_after_a_redis_restart(
    transactional_db, team, cpu_node, fake_upstream, private_redis, tmp_path
):
    setup = make_setup(team=team, node=cpu_node, upstream=fake_upstream, cap=1)
    web = start_web(
        tmp_path / "web.log",
        web_env(
            private_redis, GATEWAY_SLOT_LEASE_S="3", GATEWAY_REDIS_TIMEOUT_S="1", GATEWAY_QUEUE_TIMEOUT_S="2"
        ),
    )
    url = f"{web.url}/v1/chat/completions"
    inflight = redis_keys().inflight(setup.deployment.pk)

    def held() -> int:
        try:
            return private_redis.client().zcount(inflight, time.time() * 1000, "+inf")
        except Exception:
            return 0

    async def go():
        async with httpx.AsyncClient(timeout=60) as client:
            long = chat_body(setup.model, "FAKE chunks=300 interval=50", stream=True)  # ~15 s
            first = asyncio.create_task(client.post(url, headers=setup.headers, json=long))
            await asyncio.to_thread(
                wait_until, lambda: held() == 1, timeout_s=30, what="the stream in flight"
            )
            await asyncio.to_thread(restart, private_redis)
            # Within a renewal round (a third of the 3 s lease) the stream's slot is back.
            await asyncio.to_thread(
                wait_until, lambda: held() == 1, timeout_s=10, what="the slot re-registered"
            )
            second = await client.post(url, headers=setup.headers, json=chat_body(setup.model, "Hi"))
            return second, first.done(), await first

    upstream_reset(fake_upstream)
    try:
        second, first_done_by_then, first = run_async(go())
    finally:
        stop(web.process)
    assert not first_done_by_then and first.status_code == 200
    # The cap of 1 held: the second request waited for the slot and timed out in the queue.
    assert second.status_code == 503 and second.json()["error"]["code"] == "queue_timeout", second.text
    assert upstream_stats(fake_upstream)["max_in_flight"] == 1
