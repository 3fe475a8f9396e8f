"""The floor under the gateway's own cost: a relay that does nothing but relay.

    PERF_FLOOR_UPSTREAM=http://127.0.0.1:8199 uvicorn perf.relay_floor:app --loop uvloop --http httptools

An ASGI app on the gateway's server stack (uvicorn, uvloop, httptools) and its upstream
client (portal/gateway/upstream.py), with no key, no parsing, no quota, no Redis and no
usage: it reads the request body, sends it to the same path upstream and passes the
answer on, part by part, as the gateway's relay does. What it adds over calling the
upstream directly is what any relay in one Python process adds on this machine (one more
process to wake per request and per chunk); perf/gateway_overhead.py measures it beside
the gateway, so the gateway's figures split into that floor and the portal's own work.
"""

from __future__ import annotations

import os

from django.conf import settings

if not settings.configured:  # the upstream client reads its limits from Django's settings
    settings.configure(
        GATEWAY_MAX_CONNECTIONS=1024,
        GATEWAY_CONNECT_TIMEOUT_S=5,
        GATEWAY_READ_TIMEOUT_S=60,
        GATEWAY_UPSTREAM_IDLE_S=4.0,
        GATEWAY_UPSTREAM_MAX_HEAD_BYTES=64 * 1024,
        GATEWAY_UPSTREAM_MAX_HEADERS=100,
        GATEWAY_UPSTREAM_HEAD_TIMEOUT_S=10.0,
    )

from portal.gateway.upstream import open_stream

UPSTREAM = os.environ.get("PERF_FLOOR_UPSTREAM", "http://127.0.0.1:8199")


async def app(scope, receive, send) -> None:
    if scope["type"] == "lifespan":
        while (message := await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    parts = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        parts.append(message.get("body", b""))
        if not message.get("more_body"):
            break
    if scope["method"] == "GET":  # its health check (wait_up)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})
        return
    response = await open_stream(UPSTREAM + scope["path"], b"".join(parts), "floor")
    content_type = response.headers.get("content-type", "application/json").encode("latin1")
    await send(
        {
            "type": "http.response.start",
            "status": response.status_code,
            "headers": [(b"content-type", content_type)],
        }
    )
    try:
        while part := await response.read():
            await send({"type": "http.response.body", "body": part, "more_body": True})
    finally:
        await response.aclose()
    await send({"type": "http.response.body"})
