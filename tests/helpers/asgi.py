"""One request over ASGI without a server: the scope uvicorn builds, and its order of events."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any


def http_scope(method: str, path: str, headers: dict[str, str] | None = None) -> dict[str, Any]:
    """The scope of a plain HTTP/1.1 request to 127.0.0.1 (with a Host header) as uvicorn gives it."""
    raw = [(b"host", b"127.0.0.1")] + [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    return {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
        "path": path, "raw_path": path.encode(), "root_path": "", "query_string": b"", "headers": raw,
        "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8000),
    }  # fmt: skip


async def asgi_request(
    app: Callable[..., Awaitable[None]],
    method: str,
    path: str,
    headers: dict[str, str] | None = None,
    body: bytes = b"",
    *,
    yields_after_complete: int = 0,
) -> list[dict]:
    """One request over ASGI, with uvicorn's order of events (once the response is complete, the
    next `receive()` reports a disconnect); the messages sent, in order.

    `yields_after_complete`: how often `send` yields to the loop after the last body, as uvicorn's
    flow control does, so a disconnect listener sees the disconnect before the app returns."""
    complete = asyncio.Event()
    sent: list[dict] = []
    bodies = iter([{"type": "http.request", "body": body, "more_body": False}])

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
            for _ in range(yields_after_complete):
                await asyncio.sleep(0)

    await app(http_scope(method, path, headers), receive, send)
    return sent
