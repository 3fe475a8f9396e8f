"""Quotas and per-deployment admission through the real gateway, against the real Redis."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from devtools import free_port, wait_until
from tests.helpers.gateway import (
    OUTLASTS_THE_QUEUE,
    add_replica,
    chat_body,
    slots_in_use,
    upstream_reset,
    upstream_stats,
    wait_for_slots_free,
)
from tests.helpers.processes import run_async

pytestmark = [pytest.mark.django_db(transaction=True)]


async def send_many(gateway, setup, bodies: list[dict]) -> list[httpx.Response]:
    limits = httpx.Limits(max_connections=len(bodies) + 5)
    async with httpx.AsyncClient(limits=limits, timeout=30) as client:
        return await asyncio.gather(
            *[
                client.post(f"{gateway.url}/v1/chat/completions", headers=setup.headers, json=b)
                for b in bodies
            ]
        )


@pytest.mark.slow  # a race of 50 requests: seconds of work on 2 cores (make test runs it)
def test_it_admits_exactly_10_of_50_simultaneous_requests_against_a_limit_of_10(gateway, serving, gw_redis):
    serving.team.max_concurrent = 10
    serving.team.save()
    # Each holds its slot ~8 s: long after a loaded machine has answered all 50.
    body = chat_body(serving.model, "FAKE chunks=160 interval=50", stream=True)
    responses = run_async(send_many(gateway, serving, [body] * 50))
    statuses = [r.status_code for r in responses]
    assert statuses.count(200) == 10
    assert statuses.count(429) == 40
    refused = next(r for r in responses if r.status_code == 429)
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert int(refused.headers["retry-after"]) >= 1
    assert not any(wait_for_slots_free(gw_redis, serving).values())


def test_it_limits_requests_per_minute_per_key(gateway, team, cpu_node, fake_upstream, gw_redis):
    from tests.helpers.gateway import make_setup

    setup = make_setup(team=team, node=cpu_node, upstream=fake_upstream, key_kwargs={"rpm_limit": 3})
    statuses = [
        httpx.post(
            f"{gateway.url}/v1/chat/completions", headers=setup.headers, json=chat_body(setup.model)
        ).status_code
        for _ in range(4)
    ]
    assert statuses == [200, 200, 200, 429]


def test_it_refuses_a_request_whose_reservation_exceeds_the_token_quota(gateway, serving, gw_redis):
    serving.team.tpm_limit = 500
    serving.team.save()
    response = httpx.post(
        f"{gateway.url}/v1/chat/completions",
        headers=serving.headers,
        json=chat_body(serving.model, max_tokens=1000),
    )
    assert response.status_code == 429
    assert response.json()["error"]["code"] == "tokens_exceed_quota"


def spent_today(gw_redis, setup, tokens: int) -> None:
    """The key's daily counter as the gateway keeps it, `tokens` already spent today."""
    from portal.core.redis.client import redis_keys

    day = int(time.time() // 86400)
    gw_redis.set(redis_keys().tpd_prefix("key", setup.key.pk) + str(day), tokens, ex=86400)


def test_it_says_what_a_request_reserves_and_what_max_tokens_fits_the_days_quota(gateway, serving, gw_redis):
    """A 429 once said "the key's tokens per day quota" with Retry-After 9.5 h, while ~330 tokens
    remained and the same request with max_tokens 50 succeeded."""
    serving.key.tokens_per_day = 1000
    serving.key.save()
    spent_today(gw_redis, serving, 670)
    url = f"{gateway.url}/v1/chat/completions"
    refused = httpx.post(url, headers=serving.headers, json=chat_body(serving.model, max_tokens=500))
    assert refused.status_code == 429
    assert "retry-after" not in refused.headers  # waiting would not help: a lower max_tokens does
    message = refused.json()["error"]["message"]
    assert "330 of 1000 left today" in message
    fits = int(message.rsplit("at most ", 1)[1].split(" ")[0])
    assert 300 < fits < 330
    assert (
        httpx.post(url, headers=serving.headers, json=chat_body(serving.model, max_tokens=fits)).status_code
        == 200
    )


def test_it_tells_a_request_that_nothing_fits_today_to_wait_for_the_reset(gateway, serving, gw_redis):
    serving.key.tokens_per_day = 1000
    serving.key.save()
    spent_today(gw_redis, serving, 999)
    refused = httpx.post(
        f"{gateway.url}/v1/chat/completions",
        headers=serving.headers,
        json=chat_body(serving.model, max_tokens=5),
    )
    assert refused.status_code == 429
    assert "1 of 1000 left today" in refused.json()["error"]["message"]
    until_midnight = 86400 - time.time() % 86400
    assert until_midnight - 5 <= int(refused.headers["retry-after"]) <= until_midnight + 5


def test_it_queues_the_excess_over_a_deployment_cap(gateway, serving, gw_redis):
    serving.deployment.concurrency_cap = 2
    serving.deployment.save()
    upstream_reset(serving.upstream)
    body = chat_body(serving.model, "FAKE chunks=20 interval=50", stream=True)  # ~1 s each
    started = time.monotonic()
    responses = run_async(send_many(gateway, serving, [body] * 4))
    assert [r.status_code for r in responses] == [200] * 4
    assert upstream_stats(serving.upstream)["max_in_flight"] == 2
    assert time.monotonic() - started >= 2.0  # two waves
    assert not any(wait_for_slots_free(gw_redis, serving).values())


@pytest.mark.slow  # waits out a real timeout or a simulated acceptance
def test_it_answers_503_when_the_queue_wait_runs_out(gateway, serving, gw_redis):
    serving.deployment.concurrency_cap = 1
    serving.deployment.save()
    slow = chat_body(serving.model, OUTLASTS_THE_QUEUE, stream=True)

    def slot_taken() -> bool:
        return slots_in_use(gw_redis, serving)["deployment"] == 1

    async def go():
        async with httpx.AsyncClient(timeout=30) as client:
            first = asyncio.create_task(
                client.post(f"{gateway.url}/v1/chat/completions", headers=serving.headers, json=slow)
            )
            await asyncio.to_thread(wait_until, slot_taken, what="the slow one holding the only slot")
            second = await client.post(
                f"{gateway.url}/v1/chat/completions", headers=serving.headers, json=chat_body(serving.model)
            )
            return await first, second

    first, second = run_async(go())
    assert first.status_code == 200
    assert second.status_code == 503
    assert second.json()["error"]["code"] == "queue_timeout"
    assert second.headers["retry-after"]


def test_it_lets_at_most_two_long_prompts_into_prefill_per_deployment(gateway, serving, gw_redis):
    upstream_reset(serving.upstream)
    # ~2500 tokens by the chars/4 estimate; 1 s of "prefill" before the first of 20 chunks 50 ms apart.
    long_prompt = "word " * 2000 + "FAKE delay=1 chunks=20 interval=50"
    responses = run_async(
        send_many(gateway, serving, [chat_body(serving.model, long_prompt, stream=True)] * 3)
    )
    assert [r.status_code for r in responses] == [200] * 3
    stats = upstream_stats(serving.upstream)
    assert stats["max_in_prefill"] == 2
    # The third started when the first two sent their first token, not when their streams ended.
    assert stats["max_in_flight"] == 3
    assert not any(wait_for_slots_free(gw_redis, serving).values())


def test_it_retries_on_another_replica_before_the_first_byte(
    gateway, team, cpu_node, fake_upstream, gw_redis
):
    from tests.helpers.gateway import make_setup

    # The first (lowest id, so first choice at equal load) replica is down.
    setup = make_setup(team=team, node=cpu_node, upstream=f"http://127.0.0.1:{free_port()}")
    add_replica(setup, endpoint_url=fake_upstream)
    for stream in (True, False):
        response = httpx.post(
            f"{gateway.url}/v1/chat/completions",
            headers=setup.headers,
            json=chat_body(setup.model, stream=stream),
        )
        assert response.status_code == 200


def test_it_answers_502_when_every_replica_is_down(gateway, team, cpu_node, gw_redis):
    from tests.helpers.gateway import make_setup

    setup = make_setup(team=team, node=cpu_node, upstream=f"http://127.0.0.1:{free_port()}")
    response = httpx.post(
        f"{gateway.url}/v1/chat/completions", headers=setup.headers, json=chat_body(setup.model)
    )
    assert response.status_code == 502
    assert response.json()["error"]["code"] == "upstream_unreachable"
    assert not any(wait_for_slots_free(gw_redis, setup).values())


def test_it_spreads_requests_over_replicas_by_least_in_flight(gateway, serving, fake_upstream, gw_redis):
    second = add_replica(serving, endpoint_url=fake_upstream)
    body = chat_body(serving.model, "FAKE chunks=40 interval=50", stream=True)  # 2 s: all six overlap
    run_async(send_many(gateway, serving, [body] * 6))
    from portal.teams.models import Usage
    from portal.teams.services import usage_flush

    usage_flush()
    per_replica = {
        d: Usage.objects.filter(deployment_id=d).count() for d in (serving.deployment.pk, second.pk)
    }
    assert per_replica == {serving.deployment.pk: 3, second.pk: 3}
