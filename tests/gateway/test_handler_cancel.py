"""A client that leaves stops its request even when a library loses the first cancellation.

Python 3.11's `asyncio.wait_for` (redis-py's socket timeout) returns the result of a write that
completed as the cancel arrived; a request whose client left while queued then went upstream and
was billed as completed (tests/gateway/test_disconnects.py saw it about one run in four).
"""

from __future__ import annotations

import asyncio

from django.http import HttpResponse

from portal.gateway.asgi import GatewayHandler
from tests.helpers.asgi import http_scope

SCOPE = http_scope("POST", "/v1/chat/completions")


class LosesOneCancel(GatewayHandler):
    """A view that loses the first cancellation, as one awaiting redis-py on Python 3.11 can."""

    def __init__(self) -> None:
        super().__init__()
        self.started = asyncio.Event()
        self.lost = 0
        self.served = False

    async def get_response(self, request):
        self.started.set()
        try:
            await asyncio.sleep(30)  # queued
        except asyncio.CancelledError:
            self.lost += 1  # lost: the view goes on
        await asyncio.sleep(2)  # the upstream call and its stream
        self.served = True
        return HttpResponse("served")


async def _client_leaves_while_queued(handler: LosesOneCancel) -> float:
    bodies = iter([{"type": "http.request", "body": b"{}", "more_body": False}])

    async def receive() -> dict:
        message = next(bodies, None)
        if message is not None:
            return message
        await handler.started.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        pass

    loop = asyncio.get_running_loop()
    began = loop.time()
    await asyncio.wait_for(handler(SCOPE, receive, send), timeout=10)
    return loop.time() - began


def test_it_stops_a_view_that_lost_the_cancellation_of_a_client_that_left(settings):
    settings.ALLOWED_HOSTS = ["127.0.0.1"]
    handler = LosesOneCancel()
    took = asyncio.run(_client_leaves_while_queued(handler))
    assert handler.lost == 1
    assert not handler.served
    assert took < 2  # cancelled again, not left to finish its 2 s
