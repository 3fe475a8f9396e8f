"""The upstream client (portal/gateway/upstream.py) against an upstream that speaks HTTP badly on
purpose: every caller gets its own answer or an error, never another caller's, and nothing an
upstream sends is taken without bound."""

from __future__ import annotations

import asyncio
import json
import select

import httpx
import pytest

from devtools import stop
from portal.gateway import upstream
from tests.helpers.gateway import chat_body, make_setup, start_gateway
from tests.helpers.hostile import CLOSE, HostileUpstream, answer, own_answer

BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
EARLY_HINTS = b"HTTP/1.1 103 Early Hints\r\nLink: </style.css>; rel=preload\r\n\r\n"
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


def _run(work):
    """Each test on its own event loop, so its pool is its own."""
    return asyncio.run(work())


async def _ask(url: str, request_id: str) -> tuple[int, bytes]:
    response = await upstream.open_stream(url, BODY, request_id)
    try:
        return response.status_code, await response.aread()
    finally:
        await response.aclose()


async def _alternating_teams(url: str, rounds: int = 8) -> list[tuple[str, bytes]]:
    """Requests of two teams, one after another: (who asked, what it got)."""
    got = []
    for i in range(rounds):
        request_id = f"team-{'ab'[i % 2]}-{i}"
        status, content = await _ask(url, request_id)
        assert status == 200
        got.append((request_id, content))
    return got


def _own(got: list[tuple[str, bytes]]) -> bool:
    return all(json.loads(content) == {"answers": request_id} for request_id, content in got)


def _idle(url: str) -> list:
    return upstream._pool().idle.get(upstream.target(url).address, [])


def test_it_skips_an_early_hints_head_so_each_caller_gets_its_own_answer():
    async def work():
        async with HostileUpstream(lambda rid, n: [EARLY_HINTS, 0.01, own_answer(rid)]) as server:
            return await _alternating_teams(server.url), server.connections

    got, connections = _run(work)
    assert _own(got)
    assert connections == 1  # the connection stayed in step, so it was kept


def test_it_skips_a_100_continue_head_so_each_caller_gets_its_own_answer():
    async def work():
        async with HostileUpstream(lambda rid, n: [CONTINUE, 0.01, own_answer(rid)]) as server:
            return await _alternating_teams(server.url)

    assert _own(_run(work))


def test_an_answer_sent_after_a_complete_one_never_reaches_the_next_caller():
    async def work():
        stale = own_answer("nobody")
        async with HostileUpstream(lambda rid, n: own_answer(rid) + stale) as server:
            return await _alternating_teams(server.url), server.connections

    got, connections = _run(work)
    assert _own(got)
    assert connections == 8  # each connection that carried a stray answer was closed, not kept


def test_a_kept_connection_with_unread_bytes_waiting_is_not_taken_from_the_pool():
    async def work():
        stale = own_answer("nobody")
        async with HostileUpstream(lambda rid, n: [own_answer(rid), 0.05, stale]) as server:
            first = await _ask(server.url, "team-a-0")
            # Block the loop until the stray answer is in the socket: the loop has not read it yet
            # when the next request takes a connection (what a busy gateway sees).
            sock = _idle(server.url)[0].transport.get_extra_info("socket")
            assert select.select([sock.fileno()], [], [], 5)[0]
            second = await _ask(server.url, "team-b-1")
            return [("team-a-0", first[1]), ("team-b-1", second[1])], server.connections

    got, connections = _run(work)
    assert _own(got)
    assert connections == 2


def test_a_101_switching_protocols_fails_the_request_and_closes_its_connection():
    switch = b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n"

    async def work():
        async with HostileUpstream(lambda rid, n: [switch, own_answer(rid)]) as server:
            with pytest.raises(upstream.UpstreamProtocolError) as caught:
                await _ask(server.url, "team-a-0")
            return caught.value, _idle(server.url)

    error, idle = _run(work)
    assert error.code == "upstream_protocol_error"
    assert idle == []


def test_a_head_over_its_size_cap_is_refused_and_its_connection_closed(settings):
    settings.GATEWAY_UPSTREAM_MAX_HEAD_BYTES = 4096

    async def work():
        big = answer(b"{}", extra_head=b"X-Pad: " + b"a" * 8000 + b"\r\n")
        async with HostileUpstream(lambda rid, n: big) as server:
            with pytest.raises(upstream.UpstreamTooLarge) as caught:
                await _ask(server.url, "team-a-0")
            return caught.value, _idle(server.url)

    error, idle = _run(work)
    assert error.code == "upstream_head_too_large"
    assert idle == []


def test_a_head_with_too_many_headers_is_refused(settings):
    settings.GATEWAY_UPSTREAM_MAX_HEADERS = 20

    async def work():
        many = answer(b"{}", extra_head=b"".join(b"X-H%d: 1\r\n" % i for i in range(30)))
        async with HostileUpstream(lambda rid, n: many) as server:
            with pytest.raises(upstream.UpstreamTooLarge) as caught:
                await _ask(server.url, "team-a-0")
            return caught.value

    assert _run(work).code == "upstream_head_too_large"


def test_endless_interim_heads_count_toward_the_head_cap(settings):
    settings.GATEWAY_UPSTREAM_MAX_HEAD_BYTES = 4096

    async def work():
        async with HostileUpstream(lambda rid, n: EARLY_HINTS * 500 + own_answer(rid)) as server:
            with pytest.raises(upstream.UpstreamTooLarge):
                await _ask(server.url, "team-a-0")

    _run(work)


def test_a_head_trickled_past_its_deadline_is_a_timeout_though_bytes_keep_coming(settings):
    settings.GATEWAY_UPSTREAM_HEAD_TIMEOUT_S = 0.3
    settings.GATEWAY_READ_TIMEOUT_S = 5.0

    async def work():
        trickle = [b"HTTP/1.1 200 OK\r\n"] + [piece for _ in range(100) for piece in (0.02, b"X-A: b\r\n")]
        async with HostileUpstream(lambda rid, n: trickle) as server:
            with pytest.raises(upstream.HeadTimeout):
                await _ask(server.url, "team-a-0")
            return _idle(server.url)

    assert _run(work) == []


def test_a_whole_answer_over_its_size_cap_is_refused_and_its_connection_closed():
    async def work():
        async with HostileUpstream(lambda rid, n: answer(b"x" * 300_000)) as server:
            response = await upstream.open_stream(server.url, BODY, "team-a-0")
            with pytest.raises(upstream.UpstreamTooLarge) as caught:
                await response.aread(100_000)
            return caught.value, _idle(server.url)

    error, idle = _run(work)
    assert error.code == "upstream_too_large"
    assert idle == []


def test_a_connection_idle_past_its_limit_is_not_reused(settings):
    settings.GATEWAY_UPSTREAM_IDLE_S = 4.0  # under uvicorn's (vLLM's) 5 s keep-alive

    async def work():
        async with HostileUpstream(lambda rid, n: own_answer(rid)) as server:
            await _ask(server.url, "team-a-0")
            _idle(server.url)[0].idle_since -= 4.5  # idle 4.5 s: the engine is about to close it
            await _ask(server.url, "team-a-1")
            return server.connections

    assert _run(work) == 2


def test_a_reused_connection_closed_before_any_byte_is_retried_once_on_a_fresh_one():
    async def work():
        # The server drops its kept connection as the second request arrives, as an engine whose
        # keep-alive ran out at that moment does: it never processed that request.
        async with HostileUpstream(lambda rid, n: own_answer(rid) if n == 1 else b"") as server:
            await _ask(server.url, "team-a-0")
            status, content = await _ask(server.url, "team-b-1")
            return status, content, server.connections

    status, content, connections = _run(work)
    assert (status, json.loads(content)) == (200, {"answers": "team-b-1"})
    assert connections == 2


def test_a_reused_connection_that_failed_after_a_byte_of_its_answer_is_not_retried():
    async def work():
        script = {1: None, 2: [b"HTTP/1.1 200 OK\r\n", CLOSE]}  # closed mid-head
        async with HostileUpstream(lambda rid, n: script[n] or own_answer(rid)) as server:
            await _ask(server.url, "team-a-0")
            with pytest.raises(upstream.UpstreamError):
                await _ask(server.url, "team-b-1")
            return server.requests

    assert _run(work) == ["team-a-0", "team-b-1"]


def test_a_fresh_connection_closed_before_any_byte_is_not_retried():
    async def work():
        async with HostileUpstream(lambda rid, n: b"") as server:
            with pytest.raises(upstream.UpstreamError):
                await _ask(server.url, "team-a-0")
            return server.requests

    assert _run(work) == ["team-a-0"]


# --- through the gateway: what the client sees, what is recorded ------------------------------


@pytest.fixture
def hostile_replica(request):
    """A hostile upstream serving `request.param` (an Answer), outside any test loop."""
    server = HostileUpstream(request.param).start()
    yield server
    server.stop()


MANY_HEADERS = answer(b"{}", extra_head=b"".join(b"X-H%d: 1\r\n" % i for i in range(150)))
SWITCH = b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n"


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("hostile_replica", "code"),
    [
        (lambda rid, n: MANY_HEADERS, "upstream_head_too_large"),
        (lambda rid, n: [SWITCH, own_answer(rid)], "upstream_protocol_error"),
    ],
    ids=["a head of 150 headers", "a protocol switch"],
    indirect=["hostile_replica"],
)
def test_the_gateway_refuses_a_replicas_unrelayable_answer_with_a_502_naming_it(
    gateway, team, cpu_node, gw_redis, hostile_replica, code
):
    from portal.teams.models import Usage
    from portal.teams.services import usage_flush

    setup = make_setup(team=team, node=cpu_node, upstream=hostile_replica.base_url)
    response = httpx.post(
        f"{gateway.url}/v1/chat/completions", headers=setup.headers, json=chat_body(setup.model), timeout=30
    )
    assert response.status_code == 502
    assert response.json()["error"]["code"] == code
    usage_flush()
    [row] = Usage.objects.filter(team=team)
    assert (row.status, row.http_status, row.error_code) == ("upstream_error", 502, code)


@pytest.fixture
def strict_gateway(tmp_path):
    """A gateway of its own with small whole-answer limits: 2 s, 64 KiB."""
    found, process = start_gateway(
        tmp_path / "gateway.log", GATEWAY_ANSWER_TIMEOUT_S="2", GATEWAY_UPSTREAM_MAX_ANSWER_BYTES="65536"
    )
    yield found
    stop(process)


TRICKLE = [
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n",
    *[piece for _ in range(100) for piece in (0.2, b" ")],  # 20 s, never silent for a read timeout
]


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("hostile_replica", "status", "code"),
    [
        (lambda rid, n: TRICKLE, 504, "upstream_timeout"),
        (lambda rid, n: answer(b"x" * 200_000), 502, "upstream_too_large"),
    ],
    ids=["an answer trickled past its deadline", "an answer over its size cap"],
    indirect=["hostile_replica"],
)
def test_the_gateway_bounds_a_whole_answers_time_and_size(
    strict_gateway, team, cpu_node, gw_redis, hostile_replica, status, code
):
    setup = make_setup(team=team, node=cpu_node, upstream=hostile_replica.base_url)
    response = httpx.post(
        f"{strict_gateway.url}/v1/chat/completions",
        headers=setup.headers,
        json=chat_body(setup.model),
        timeout=30,
    )
    assert (response.status_code, response.json()["error"]["code"]) == (status, code)
