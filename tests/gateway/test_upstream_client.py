"""The gateway's own upstream client (portal/gateway/upstream.py) against the real fake upstream:
connections kept and reused, dropped when an answer is left half-read, and every failure an
error the gateway can tell apart (a replica that failed, one that was slow, one unreachable)."""

from __future__ import annotations

import asyncio
import json

import pytest

from devtools import free_port, wait_until
from portal.core.redis.client import redis_keys
from portal.gateway import upstream, upstream_names
from tests.helpers.gateway import upstream_reset, upstream_stats


def _body(content: str = "Hello", *, stream: bool = True, max_tokens: int = 4) -> bytes:
    body = {"model": "m", "messages": [{"role": "user", "content": content}], "stream": stream}
    return json.dumps({**body, "max_tokens": max_tokens}).encode()


def _run(work):
    """Each test on its own event loop, so its pool is its own."""
    return asyncio.run(work())


async def _whole(url: str, body: bytes) -> tuple[int, bytes]:
    response = await upstream.open_stream(url, body, "req-1")
    content = await response.aread()
    await response.aclose()
    return response.status_code, content


def test_it_reuses_one_connection_for_answers_read_whole(fake_upstream):
    url = f"{fake_upstream}/v1/chat/completions"

    async def work():
        answers = [await _whole(url, _body()) for _ in range(3)]
        idle = upstream._pool().idle[upstream.target(url).address]
        return answers, len(idle)

    answers, idle = _run(work)
    assert all(status == 200 and content.endswith(b"data: [DONE]\n\n") for status, content in answers)
    assert idle == 1


def test_a_burst_opens_one_connection_per_concurrent_answer_and_keeps_them(fake_upstream):
    url = f"{fake_upstream}/v1/chat/completions"

    async def work():
        for _ in range(2):
            await asyncio.gather(*[_whole(url, _body()) for _ in range(8)])
        return len(upstream._pool().idle[upstream.target(url).address])

    assert _run(work) == 8


def test_an_answer_left_half_read_drops_its_connection_so_upstream_sees_the_disconnect(fake_upstream):
    upstream_reset(fake_upstream)
    url = f"{fake_upstream}/v1/chat/completions"

    async def work():
        response = await upstream.open_stream(url, _body("FAKE chunks=200 interval=20"), "req-1")
        first = await response.read()
        await response.aclose()
        return first, upstream._pool().idle.get(upstream.target(url).address, [])

    first, idle = _run(work)
    assert first.startswith(b"data: ")
    assert idle == []
    wait_until(lambda: upstream_stats(fake_upstream)["disconnected"] == 1, what="the disconnect")


def test_a_stream_cut_by_upstream_is_an_upstream_error(fake_upstream):
    url = f"{fake_upstream}/v1/chat/completions"

    async def work():
        response = await upstream.open_stream(url, _body("FAKE die_after=2", max_tokens=10), "req-1")
        with pytest.raises(upstream.UPSTREAM_ERRORS) as caught:
            while await response.read():
                pass
        await response.aclose()
        return caught.value

    error = _run(work)
    assert isinstance(error, upstream.UpstreamError) and not isinstance(error, TimeoutError)


def test_silence_past_the_read_timeout_is_a_read_timeout(fake_upstream, settings):
    settings.GATEWAY_READ_TIMEOUT_S = 0.3
    url = f"{fake_upstream}/v1/chat/completions"

    async def work():
        # Nothing comes for 3 s: neither the answer's head nor its first chunk.
        with pytest.raises(upstream.ReadTimeout):
            await upstream.open_stream(url, _body("FAKE delay=3"), "req-1")

    _run(work)


def test_the_read_timeout_counts_silence_between_chunks_not_the_whole_stream(fake_upstream, settings):
    settings.GATEWAY_READ_TIMEOUT_S = 1.0
    url = f"{fake_upstream}/v1/chat/completions"

    async def work():
        # Six chunks 0.2 s apart: 1.2 s in all, longer than the timeout, never 1 s of silence
        # (0.8 s to spare for a loaded machine's scheduling).
        steady = await _whole(url, _body("FAKE chunks=6 interval=200", max_tokens=6))
        # Chunks three seconds apart: the first arrives, the wait for the second outlasts the timeout.
        response = await upstream.open_stream(url, _body("FAKE chunks=3 interval=3000"), "req-2")
        first = await response.read()
        with pytest.raises(upstream.ReadTimeout):
            while await response.read():
                pass
        await response.aclose()
        return steady, first

    (status, content), first = _run(work)
    assert status == 200 and content.count(b"\n\ndata: ") >= 6
    assert first.startswith(b"data: ")


def test_a_closed_port_is_an_upstream_error_not_a_timeout():
    async def work():
        with pytest.raises(upstream.UPSTREAM_ERRORS) as caught:
            await upstream.open_stream(f"http://127.0.0.1:{free_port()}/v1/completions", _body(), "req-1")
        return caught.value

    error = _run(work)
    assert not isinstance(error, TimeoutError)


def test_it_sends_the_server_key_and_refuses_one_that_would_split_the_head(fake_upstream):
    url = f"{fake_upstream}/v1/chat/completions"

    async def work():
        response = await upstream.open_stream(url, _body(), "req-1", "server-key")
        await response.aread()
        with pytest.raises(upstream.UpstreamError):
            await upstream.open_stream(url, _body(), "req-2", "key\r\nX-Evil: 1")

    _run(work)
    assert upstream_stats(fake_upstream)["last_authorization"] == "Bearer server-key"


def test_an_error_status_comes_with_its_body(fake_upstream):
    url = f"{fake_upstream}/v1/chat/completions"
    status, content = _run(lambda: _whole(url, _body("FAKE status=500", stream=False)))
    assert status == 500 and content


@pytest.mark.parametrize(
    ("url", "address", "head"),
    [
        ("http://10.0.0.5:8000/v1/chat/completions", ("10.0.0.5", 8000, False), b"Host: 10.0.0.5:8000"),
        ("https://llm.example.org/v1/completions", ("llm.example.org", 443, True), b"Host: llm.example.org"),
        ("http://[::1]:9000/v1/completions?x=1", ("::1", 9000, False), b"Host: [::1]:9000"),
    ],
)
def test_it_splits_a_replica_url_once_into_address_and_request_head(url, address, head):
    where = upstream.target(url)
    assert where.address == address
    assert where.head.startswith(b"POST /v1/") and head in where.head


def test_it_refuses_what_is_not_an_http_url():
    with pytest.raises(upstream.UpstreamError):
        upstream.target("ftp://10.0.0.5/v1/completions")


def test_a_kept_connection_that_the_server_answers_unasked_and_closes_is_not_reused():
    """A server may send a 408 on an idle keep-alive connection before closing it (uvicorn and
    nginx do): that connection is dropped, and the next request gets a fresh one."""
    answer = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
    timeout_notice = b"HTTP/1.1 408 Request Timeout\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"

    async def work():
        connections = 0
        first_answered = asyncio.Event()

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal connections
            connections += 1
            number = connections
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                await reader.readexactly(length)
                writer.write(answer)
                await writer.drain()
                if number == 1:
                    first_answered.set()
                    await asyncio.sleep(0.05)
                    writer.write(timeout_notice)
                    writer.close()
                    return

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/completions"
        async with server:
            assert await _whole(url, _body()) == (200, b"{}")
            idle = upstream._pool().idle[upstream.target(url).address]
            await first_answered.wait()
            for _ in range(200):  # until the notice and the close have reached the kept connection
                if idle[0].closed:
                    break
                await asyncio.sleep(0.01)
            assert idle[0].closed
            assert await _whole(url, _body()) == (200, b"{}")
        return connections

    assert _run(work) == 2


def test_a_full_pool_closes_an_idle_connection_to_another_replica_to_make_room(fake_upstream, settings):
    """One connection allowed: kept idle for one replica, it must not keep a request to another
    waiting for GATEWAY_CONNECT_TIMEOUT_S and refused as a busy pool."""
    settings.GATEWAY_MAX_CONNECTIONS = 1
    settings.GATEWAY_CONNECT_TIMEOUT_S = 2
    answer = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"

    async def work():
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            head = await reader.readuntil(b"\r\n\r\n")
            await reader.readexactly(int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0]))
            writer.write(answer)
            await writer.drain()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        other = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/completions"
        async with server:
            first = await _whole(f"{fake_upstream}/v1/chat/completions", _body())
            # Without room made, this waits GATEWAY_CONNECT_TIMEOUT_S and raises PoolTimeout.
            second = await _whole(other, _body())
        return first[0], second

    first, second = _run(work)
    assert first == 200 and second == (200, b"{}")


def test_a_replica_whose_name_does_not_resolve_is_logged_once_counted_and_leaves_no_stray_future(caplog):
    from portal.observability import prometheus

    url = "http://replica-that-does-not-resolve.invalid:8000/v1/chat/completions"
    upstream_names._name_errors_logged.clear()
    key = (prometheus.UPSTREAM_CONNECT_ERRORS, "replica-that-does-not-resolve.invalid", "name_resolution")

    def counted() -> float:
        prometheus.recorder.flush()
        stored = prometheus.client().hget(redis_keys().metrics_counters, prometheus.encode_field(key))
        return float(stored or 0)

    before = counted()
    stray = []

    async def work():
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: stray.append(context))
        failures = []
        for _ in range(3):
            with pytest.raises(upstream.NameNotResolved) as raised:
                await upstream.open_stream(url, _body(), "req-1")
            failures.append(raised.value)
        import gc

        gc.collect()  # an unretrieved future's complaint is made when it is collected
        await asyncio.sleep(0)
        return failures

    with caplog.at_level("WARNING", logger="portal.gateway.upstream"):
        failures = _run(work)
    assert "does not resolve" in str(failures[0])
    assert isinstance(failures[0], OSError)  # the gateway's "replica failed" errors: another is tried
    logged = [r for r in caplog.records if "does not resolve" in r.getMessage()]
    assert len(logged) == 1
    assert counted() - before == 3
    assert stray == []
