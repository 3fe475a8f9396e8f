"""A request's concurrency slots hold while it waits in the queue: a batch request may wait far
longer than one slot lease (GATEWAY_SLOT_LEASE_S), and its team's and key's `max_concurrent`
must still count it the whole time."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from devtools import stop, wait_until
from portal.core.redis.client import redis_keys
from tests.helpers.gateway import chat_body, slots_in_use, start_gateway, wait_for_slots_free
from tests.helpers.processes import run_async

pytestmark = [pytest.mark.django_db(transaction=True)]

LEASE_S = 2  # renewed every 2/3 s; the batch request below waits well past it


@pytest.fixture
def short_lease_gateway(serving, tmp_path):
    found, process = start_gateway(
        tmp_path / "gateway.log",
        GATEWAY_SLOT_LEASE_S=str(LEASE_S),
        GATEWAY_REDIS_TIMEOUT_S="0.5",  # at most a third of the lease
        GATEWAY_BATCH_QUEUE_TIMEOUT_S="20",
    )
    yield found
    stop(process)


@pytest.mark.slow  # waits out real leases: out of make test-fast
def test_a_batch_request_waiting_past_the_lease_still_counts_against_its_keys_max_concurrent(
    short_lease_gateway, serving, gw_redis
):
    from portal.teams.services import api_key_create

    serving.deployment.concurrency_cap = 2  # batch share 0.5: one slot for batch
    serving.deployment.save()
    key, token = api_key_create(
        team=serving.team,
        name="offline",
        allowed_models=[serving.model],
        priority_class="batch",
        max_concurrent=1,
    )
    batch = {"Authorization": f"Bearer {token}"}
    url = f"{short_lease_gateway.url}/v1/chat/completions"
    conc = redis_keys().concurrency("key", key.pk)

    def live(zset: str) -> int:
        return gw_redis.zcount(zset, time.time() * 1000, "+inf")

    async def go():
        async with httpx.AsyncClient(timeout=60) as client:
            # An interactive stream takes the batch share: the batch request must wait in the queue.
            hold = chat_body(serving.model, "FAKE chunks=200 interval=50", stream=True)  # ~10 s
            interactive = asyncio.create_task(client.post(url, headers=serving.headers, json=hold))
            await asyncio.to_thread(
                wait_until,
                lambda: slots_in_use(gw_redis, serving)["deployment"] == 1,
                what="stream in flight",
            )
            first = asyncio.create_task(client.post(url, headers=batch, json=chat_body(serving.model)))
            await asyncio.to_thread(
                wait_until,
                lambda: gw_redis.zcard(redis_keys().batch_queue(serving.model)) == 1,
                what="queued",
            )
            queued_at = time.time()
            # Past two leases in the queue (the time itself is what is tested), the key's slot is still held.
            await asyncio.to_thread(
                wait_until, lambda: time.time() > queued_at + 2 * LEASE_S + 0.5, what="two leases gone by"
            )
            held_while_waiting = live(conc)
            second = await client.post(url, headers=batch, json=chat_body(serving.model))
            return held_while_waiting, second, await first, await interactive

    held, second, first, interactive = run_async(go())
    assert held == 1
    assert second.status_code == 429, second.text
    assert second.json()["error"]["code"] == "rate_limit_exceeded"
    assert "key's concurrent requests" in second.json()["error"]["message"]
    assert first.status_code == 200 and interactive.status_code == 200
    assert not any(wait_for_slots_free(gw_redis, serving).values())
    assert live(conc) == 0
