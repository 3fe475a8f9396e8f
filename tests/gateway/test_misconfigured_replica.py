"""A replica that answers 401/404 (its server key or served model name is wrong) or a 200 that
closes with no bytes is a broken replica, not an answer: the request moves to another replica, and
with none left the client gets a 502 `upstream_error`, recorded as such (never `completed`)."""

from __future__ import annotations

import json

import httpx
import pytest

from devtools import stop
from portal.core.redis.client import redis_keys
from tests.helpers.gateway import add_replica, chat_body, make_setup, spawn_fake_upstream, wait_for_slots_free

pytestmark = [pytest.mark.django_db(transaction=True)]


@pytest.fixture(scope="module", params=[("--status", "401"), ("--status", "404"), ("--empty",)], ids=str)
def broken_upstream(request):
    url, process = spawn_fake_upstream(5, *request.param)
    yield url
    stop(process)


def record_of(client, request_id: str) -> dict:
    records = [json.loads(r) for r in client.lrange(redis_keys().usage, 0, -1)]
    return next(r for r in records if r["request_id"] == request_id)


@pytest.mark.parametrize("stream", [True, False])
def test_a_misconfigured_replica_is_skipped_for_a_working_one(
    gateway, team, cpu_node, broken_upstream, fake_upstream, gw_redis, stream
):
    setup = make_setup(team=team, node=cpu_node, upstream=broken_upstream)  # first in line when idle
    add_replica(setup, endpoint_url=fake_upstream)
    response = httpx.post(
        f"{gateway.url}/v1/chat/completions",
        headers=setup.headers,
        json=chat_body(setup.model, stream=stream),
        timeout=30,
    )
    assert response.status_code == 200, response.text
    assert b"tok" in response.content
    assert record_of(gw_redis, response.headers["x-request-id"])["status"] == "completed"
    assert not any(wait_for_slots_free(gw_redis, setup).values())


@pytest.mark.parametrize("stream", [True, False])
def test_a_misconfigured_last_replica_is_a_502_recorded_as_an_upstream_error(
    gateway, team, cpu_node, broken_upstream, gw_redis, stream
):
    setup = make_setup(team=team, node=cpu_node, upstream=broken_upstream)
    response = httpx.post(
        f"{gateway.url}/v1/chat/completions",
        headers=setup.headers,
        json=chat_body(setup.model, stream=stream),
        timeout=30,
    )
    assert response.status_code == 502, response.text
    assert response.json()["error"]["code"] == "upstream_error"
    record = record_of(gw_redis, response.headers["x-request-id"])
    assert (record["status"], record["http_status"]) == ("upstream_error", 502)
    assert not any(wait_for_slots_free(gw_redis, setup).values())
