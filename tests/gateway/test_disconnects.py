"""A client that goes away at any point: slots are released, upstream is closed or never reached."""

from __future__ import annotations

import asyncio
import json
import socket

import pytest

from devtools import wait_until
from portal.core.redis.client import redis_keys
from tests.helpers.gateway import chat_body, slots_in_use, upstream_reset, upstream_stats, wait_for_slots_free
from tests.helpers.processes import run_async

pytestmark = [pytest.mark.django_db(transaction=True)]


def raw_request(gateway_url: str, setup, body: dict) -> socket.socket:
    host, port = gateway_url.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)))
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: " + host.encode() + b"\r\n"
        + f"Authorization: Bearer {setup.token}\r\n".encode()
        + b"Content-Type: application/json\r\n"
        + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload
    )  # fmt: skip
    return sock


def usage_statuses(setup) -> list[str]:
    from portal.teams.models import Usage
    from portal.teams.services import usage_flush

    usage_flush()
    return list(Usage.objects.filter(team=setup.team).order_by("created_at").values_list("status", flat=True))


def test_it_releases_the_slot_when_the_client_leaves_before_the_first_byte(gateway, serving, gw_redis):
    serving.team.max_concurrent = 3
    serving.team.save()
    # Upstream's first byte comes 5 s after the request: the client leaves as soon as it is placed.
    sock = raw_request(gateway.url, serving, chat_body(serving.model, "FAKE delay=5", stream=True))
    wait_until(lambda: slots_in_use(gw_redis, serving)["deployment"] == 1, what="the request placed")
    sock.close()
    assert not any(wait_for_slots_free(gw_redis, serving).values())
    wait_until(
        lambda: usage_statuses(serving) == ["client_cancelled"], what="the request accounted as cancelled"
    )


def test_it_closes_the_upstream_stream_when_the_client_leaves_mid_stream(gateway, serving, gw_redis):
    serving.team.max_concurrent = 3
    serving.team.save()
    upstream_reset(serving.upstream)
    sock = raw_request(
        gateway.url, serving, chat_body(serving.model, "FAKE chunks=1000 interval=20", stream=True)
    )
    assert sock.recv(4096).startswith(b"HTTP/1.1 200")
    sock.close()
    assert not any(wait_for_slots_free(gw_redis, serving).values())
    # Upstream saw the disconnect long before its 20 s stream would have ended.
    wait_until(
        lambda: upstream_stats(serving.upstream)["disconnected"] == 1,
        timeout_s=15,
        what="the upstream dropped",
    )
    assert upstream_stats(serving.upstream)["completed"] == 0
    wait_until(
        lambda: usage_statuses(serving) == ["client_cancelled"], what="the request accounted as cancelled"
    )


def tokens_charged_today(client, scope: str, id: int) -> int:
    """The tokens-per-day counter of a team or key (one per UTC day; today's is the only one)."""
    return sum(int(client.get(name)) for name in client.scan_iter(redis_keys().tpd_prefix(scope, id) + "*"))


@pytest.mark.slow  # waits out a real timeout or a simulated acceptance
def test_it_never_sends_upstream_a_request_whose_client_left_while_queued(gateway, serving, gw_redis):
    from portal.teams.models import Usage

    serving.deployment.concurrency_cap = 1
    serving.deployment.save()
    serving.team.max_concurrent = 5
    serving.team.tokens_per_day = 10**6
    serving.team.save()
    serving.key.max_concurrent = 5
    serving.key.tokens_per_day = 10**6
    serving.key.save()
    upstream_reset(serving.upstream)
    first = raw_request(  # holds the only slot 3 s, so the second queues however late it arrives
        gateway.url, serving, chat_body(serving.model, "FAKE chunks=60 interval=50", stream=True)
    )
    assert first.recv(4096).startswith(b"HTTP/1.1 200")
    queued = raw_request(gateway.url, serving, chat_body(serving.model, stream=True))
    queue = redis_keys().queue(serving.model)
    wait_until(lambda: gw_redis.zcard(queue) == 1, what="the second request queued")
    queued.close()
    # Gone from the queue when its client left, not at the queue timeout (its usage row says which).
    wait_until(lambda: gw_redis.zcard(queue) == 0, what="the queue empty")
    while first.recv(65536):  # let the first stream finish
        pass
    first.close()
    # The queued request's team and key slots are released now, not when their leases lapse.
    assert not any(wait_for_slots_free(gw_redis, serving).values())
    stats = upstream_stats(serving.upstream)
    assert stats["started"] == 1, (stats, usage_statuses(serving))  # the queued one never went upstream
    wait_until(
        lambda: sorted(usage_statuses(serving)) == ["client_cancelled", "completed"],
        what="one request accounted as cancelled and one as completed",
    )
    # Its token reservation (prompt + max_tokens) is refunded whole: only the completed one is charged.
    done = Usage.objects.get(team=serving.team, status="completed")
    charged = done.prompt_tokens + done.completion_tokens
    assert tokens_charged_today(gw_redis, "team", serving.team.pk) == charged
    assert tokens_charged_today(gw_redis, "key", serving.key.pk) == charged


async def _open_and_drop(gateway_url, setup, n: int) -> None:
    host, port = gateway_url.removeprefix("http://").split(":")
    body = json.dumps(chat_body(setup.model, "FAKE chunks=100 interval=10", stream=True)).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {setup.token}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()

    async def one(i: int) -> None:
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(head + body)
        await writer.drain()
        if i % 2:
            await reader.read(100)  # some leave after the first byte, some before
        writer.close()

    await asyncio.gather(*[one(i) for i in range(n)])


def test_it_releases_every_slot_when_many_clients_leave_at_once(gateway, serving, gw_redis):
    serving.team.max_concurrent = 100
    serving.team.save()
    run_async(_open_and_drop(gateway.url, serving, 30))
    assert not any(wait_for_slots_free(gw_redis, serving, timeout=10).values())
