"""The lean `/v1/` handler frees each request as it ends, without waiting for the cycle collector.

The soak (perf/soak.py) found the web process growing ~15 MB a minute under 200 streams:
every request's objects stayed in a reference cycle through the disconnect exception
until a full GC pass, which the process's GC thresholds (portal/asgi.py) make rare.
"""

from __future__ import annotations

import asyncio
import gc

from portal.gateway.asgi import GatewayHandler, GatewayRequest


def _live_requests() -> int:
    # type(), not isinstance(): isinstance() on a dead weakref.proxy elsewhere in the heap raises.
    return sum(1 for o in gc.get_objects() if type(o) is GatewayRequest)


async def _one_request(handler: GatewayHandler) -> list[dict]:
    """One `GET /v1/models` (no key: a 401) over ASGI, with uvicorn's order of events: once the
    response is complete, the next `receive()` reports a disconnect."""
    complete = asyncio.Event()
    sent: list[dict] = []
    bodies = iter([{"type": "http.request", "body": b"", "more_body": False}])

    async def receive() -> dict:
        message = next(bodies, None)
        if message is not None:
            return message
        await complete.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body"):
            complete.set()
            for _ in range(3):  # as uvicorn's flow control does: the listener sees the disconnect first
                await asyncio.sleep(0)

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET", "scheme": "http",
        "path": "/v1/models", "raw_path": b"/v1/models", "root_path": "", "query_string": b"",
        "headers": [(b"host", b"127.0.0.1")], "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8000),
    }  # fmt: skip
    await handler(scope, receive, send)
    return sent


def test_a_finished_request_is_freed_by_reference_counting_alone(settings):
    settings.ALLOWED_HOSTS = ["127.0.0.1"]
    handler = GatewayHandler()
    gc.collect()
    before = _live_requests()
    gc.disable()
    try:
        for _ in range(5):
            sent = asyncio.run(_one_request(handler))
            assert sent[0]["status"] == 401
        assert _live_requests() == before
    finally:
        gc.enable()
