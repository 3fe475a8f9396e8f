"""Refuse a request body over the limit before reading it whole (ASGI middleware).

Django's ASGI handler reads the whole body (spilling to a temporary file) before any
view can look at its size, so a chunked upload with no Content-Length would be
read to the end before a 413. This wrapper answers 413 at once when the declared
Content-Length is over the limit, and otherwise counts the bytes as the handler
reads them: past the limit it tells the handler the client left (Django then drops
the request without answering) and sends the 413 itself, with `Connection: close`
so the server stops reading the rest of the body. At most the limit plus one ASGI
message (uvicorn hands over at most 64 KiB at a time) is ever held.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]


def declared_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # uvicorn refuses a malformed length before we see it
    return None


class BodyLimit:
    """Wrap an ASGI app so no HTTP request body larger than `limit()` bytes is read.

    `refusal(limit)` gives the 413's (content type, body); `limit` is read per request so
    tests can change the setting.
    """

    def __init__(self, app: App, *, limit: Callable[[], int], refusal: Callable[[int], tuple[str, bytes]]):
        self.app = app
        self.limit = limit
        self.refusal = refusal

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.limit()
        declared = declared_length(scope)
        if declared is not None and declared > limit:
            return await self._refuse(send, limit)
        received = 0
        cut = False

        async def counting_receive() -> Message:
            nonlocal received, cut
            if cut:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    cut = True
                    return {"type": "http.disconnect"}
            return message

        await self.app(scope, counting_receive, send)
        if cut:
            # Django's handler took the cut for a disconnect while reading the body, so nothing was sent.
            await self._refuse(send, limit)

    async def _refuse(self, send: Send, limit: int) -> None:
        content_type, body = self.refusal(limit)
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", content_type.encode()),
                    (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
