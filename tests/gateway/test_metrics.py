"""The gateway's requests move the portal's metrics: real uvicorn, real Redis, scraped at /metrics."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from devtools import wait_until
from portal.core.redis.client import redis_keys
from portal.observability.selectors import traffic_last_hour
from portal.observability.services import queue_depth_sample
from tests.helpers.gateway import OUTLASTS_THE_QUEUE, chat_body, slots_in_use
from tests.helpers.metrics import TOKEN, scrape, value
from tests.helpers.processes import run_async

pytestmark = [pytest.mark.django_db(transaction=True)]


@pytest.fixture(autouse=True)
def metrics_token(settings):
    settings.PORTAL_METRICS_TOKEN = TOKEN


def settle(client) -> None:
    """Wait until the gateway process has flushed what earlier tests' requests counted: its counters
    stay put across more than a flush interval (PORTAL_METRICS_FLUSH_S = 1 s), however late it runs."""

    def gateway_samples() -> dict:
        return {k: v for k, v in scrape(client).items() if k[0].startswith("portal_gateway_")}

    deadline = time.monotonic() + 60
    last = gateway_samples()
    while True:
        time.sleep(1.5)
        now = gateway_samples()
        if now == last:
            return
        assert time.monotonic() < deadline, "the gateway's counters were still moving after 60 s"
        last = now


def scrape_until(client, done, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape(client)
        if done(samples) or time.monotonic() > deadline:
            return samples
        time.sleep(0.2)


def delta(before: dict, after: dict, name: str, **labels) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


def test_gateway_requests_move_the_metrics(gateway, serving, gw_redis, client):
    settle(client)
    before = scrape(client)
    url = f"{gateway.url}/v1/chat/completions"
    model = serving.model
    with httpx.Client(timeout=10) as http:
        assert http.post(
            url, headers=serving.headers, json=chat_body(model, stream=True, max_tokens=7)
        ).is_success
        assert http.post(url, headers=serving.headers, json=chat_body(model, max_tokens=5)).is_success
        assert http.post(url, headers=serving.headers, json=chat_body(model, bogus=1)).status_code == 400
        assert (
            http.post(url, headers=serving.headers, json=chat_body(model, "FAKE status=500")).status_code
            == 502
        )
        assert http.post(url, headers=serving.headers, json=chat_body("no-such-model")).status_code in (
            403,
            404,
        )
        bad_key = {"Authorization": "Bearer sk-nope.nope"}
        assert http.post(url, headers=bad_key, json=chat_body(model)).status_code == 401

    requests = "portal_gateway_requests_total"
    after = scrape_until(
        client,
        lambda s: (
            delta(before, s, requests, model="", endpoint="chat", status="rejected", code="401") >= 1
            and delta(before, s, requests, model=model, endpoint="chat", status="completed", code="200") >= 2
        ),
    )
    assert delta(before, after, requests, model=model, endpoint="chat", status="completed", code="200") == 2
    assert (
        delta(before, after, requests, model=model, endpoint="chat", status="upstream_error", code="502") == 1
    )
    assert delta(before, after, requests, model="", endpoint="chat", status="rejected", code="401") == 1
    for reason in ("invalid_api_key", "unknown_parameter"):
        assert delta(before, after, "portal_gateway_rejections_total", reason=reason) == 1, reason
    assert (
        delta(before, after, "portal_gateway_upstream_errors_total", model=model, reason="upstream_error")
        == 1
    )
    completion = delta(before, after, "portal_gateway_tokens_total", model=model, kind="completion")
    assert completion == 7 + 5
    assert delta(before, after, "portal_gateway_tokens_total", model=model, kind="prompt") > 0
    # Only the streamed answer has a time to first token (the non-streamed one arrives whole; the 502
    # had no first byte). All three have a duration.
    assert value(after, "portal_gateway_ttft_seconds_count", model=model) == 1
    assert value(after, "portal_gateway_request_duration_seconds_count", model=model) == 3
    assert value(after, "portal_gateway_request_duration_seconds_bucket", model=model, le="+Inf") == 3
    assert value(after, "portal_gateway_inflight_requests", deployment=serving.deployment.name) == 0

    # The dashboard's last-hour series counted them too (this minute, or the last if it just turned).
    recent = traffic_last_hour()[-2:]
    assert sum(m.requests for m in recent) >= 6
    assert sum(m.errors for m in recent) >= 1 and sum(m.rejected for m in recent) >= 3


@pytest.mark.slow  # waits out a real timeout or a simulated acceptance
def test_queue_depth_and_in_flight_are_read_live_and_a_queue_timeout_is_a_rejection(
    gateway, serving, gw_redis, client
):
    serving.deployment.concurrency_cap = 1
    serving.deployment.save()
    settle(client)
    before = scrape(client)
    url = f"{gateway.url}/v1/chat/completions"
    slow = chat_body(serving.model, OUTLASTS_THE_QUEUE, stream=True)

    def slot_taken() -> bool:
        return slots_in_use(gw_redis, serving)["deployment"] == 1

    def queued() -> bool:
        return gw_redis.zcard(redis_keys().queue(serving.model)) == 1

    async def go():
        async with httpx.AsyncClient(timeout=30) as http:
            first = asyncio.create_task(http.post(url, headers=serving.headers, json=slow))
            await asyncio.to_thread(wait_until, slot_taken, what="the slow one holding the only slot")
            second = asyncio.create_task(
                http.post(url, headers=serving.headers, json=chat_body(serving.model))
            )
            await asyncio.to_thread(wait_until, queued, what="the second waiting in the model's queue")
            during = await asyncio.to_thread(scrape, client)
            sampled = await asyncio.to_thread(queue_depth_sample)
            return await first, await second, during, sampled

    first, second, during, sampled = run_async(go())
    assert (first.status_code, second.status_code) == (200, 503)
    assert value(during, "portal_gateway_queue_depth", model=serving.model) == 1
    assert value(during, "portal_gateway_inflight_requests", deployment=serving.deployment.name) == 1
    assert sampled == 1
    after = scrape_until(
        client, lambda s: delta(before, s, "portal_gateway_rejections_total", reason="queue_timeout") >= 1
    )
    assert delta(before, after, "portal_gateway_rejections_total", reason="queue_timeout") == 1
    assert value(after, "portal_gateway_queue_depth", model=serving.model) == 0
    assert max(m.queue_depth or 0 for m in traffic_last_hour()[-2:]) == 1
