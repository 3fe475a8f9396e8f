"""The lean `/v1/` handler frees each request as it ends, without waiting for the cycle collector.

The soak (perf/soak.py) found the web process growing ~15 MB a minute under 200 streams:
every request's objects stayed in a reference cycle through the disconnect exception
until a full GC pass, which the process's GC thresholds (portal/asgi.py) make rare.
"""

from __future__ import annotations

import asyncio
import gc

from portal.gateway.asgi import GatewayHandler, GatewayRequest
from tests.helpers.asgi import asgi_request


def _live_requests() -> int:
    # type(), not isinstance(): isinstance() on a dead weakref.proxy elsewhere in the heap raises.
    return sum(1 for o in gc.get_objects() if type(o) is GatewayRequest)


def test_a_finished_request_is_freed_by_reference_counting_alone(settings):
    settings.ALLOWED_HOSTS = ["127.0.0.1"]
    handler = GatewayHandler()
    gc.collect()
    before = _live_requests()
    gc.disable()
    try:
        for _ in range(5):
            # No key: a 401. The listener sees the disconnect first, as under uvicorn.
            sent = asyncio.run(asgi_request(handler, "GET", "/v1/models", yields_after_complete=3))
            assert sent[0]["status"] == 401
        assert _live_requests() == before
    finally:
        gc.enable()
