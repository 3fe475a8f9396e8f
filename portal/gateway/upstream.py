"""Step 4: the one shared upstream client.

httpx's API over the aiohttp transport (`httpx_aiohttp`): under many concurrent
streams httpx's default transport reached only ~20 % of direct throughput here,
the aiohttp transport ~80 % (docs/architecture.md#gateway-upstream-client). One client and one transport (one
connection pool) per event loop, with explicit timeouts and pool limits; `read`
is the longest gap allowed between two chunks.

The proxy's requests go through the client's transport with httpx's public
transport API (`handle_async_request`): the client's per-request machinery
(cookie extraction through `http.cookiejar`, auth and redirect flows) cost
~0.4 ms of CPU per request here and does nothing for a pass-through.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import aiohttp
import httpx
from django.conf import settings
from httpx_aiohttp import AiohttpTransport, HttpxAiohttpClient

_shared: dict[int, tuple[httpx.AsyncClient, AiohttpTransport, dict]] = {}


def _get() -> tuple[httpx.AsyncClient, AiohttpTransport, dict]:
    loop = asyncio.get_running_loop()
    found = _shared.get(id(loop))
    if found is None:
        limits = httpx.Limits(
            max_connections=settings.GATEWAY_MAX_CONNECTIONS,
            max_keepalive_connections=settings.GATEWAY_MAX_CONNECTIONS,
            keepalive_expiry=30,
        )
        timeout = httpx.Timeout(
            connect=settings.GATEWAY_CONNECT_TIMEOUT_S,
            read=settings.GATEWAY_READ_TIMEOUT_S,
            write=settings.GATEWAY_CONNECT_TIMEOUT_S,
            pool=settings.GATEWAY_CONNECT_TIMEOUT_S,
        )
        transport = AiohttpTransport(limits=limits, trust_env=False)
        shared = HttpxAiohttpClient(transport=transport, timeout=timeout, limits=limits, trust_env=False)
        found = _shared[id(loop)] = (shared, transport, timeout.as_dict())
    return found


def client() -> httpx.AsyncClient:
    """The shared client (same pool), for anything off the proxy's hot path."""
    return _get()[0]


async def open_stream(
    url: httpx.URL | str, body: bytes, request_id: str, api_key: str = ""
) -> httpx.Response:
    """POST to upstream; returns once its status and headers are in (body not read).

    `api_key` is the replica's own server key (the client's gateway key never goes upstream).
    """
    _client, transport, timeout = _get()
    headers = {"content-type": "application/json", "x-request-id": request_id}
    if api_key:
        headers["authorization"] = f"Bearer {api_key}"
    request = httpx.Request("POST", url, content=body, headers=headers, extensions={"timeout": timeout})
    return await transport.handle_async_request(request)


Read = Callable[[], Awaitable[bytes]]


def body_reader(response: httpx.Response) -> Read:
    """A function that returns the response body's next bytes as they arrive, and b"" at its end.

    Straight from aiohttp's stream: httpx_aiohttp's iterator puts an async generator and a
    re-chunking read in front of every chunk, which a pass-through does not need. Its errors are
    aiohttp's own (in UPSTREAM_ERRORS; a read timeout is also a TimeoutError). Another transport
    is read through httpx's byte stream."""
    raw = getattr(response.stream, "_aiohttp_response", None)
    if raw is not None:
        return raw.content.readany
    chunks = aiter(response.stream)

    async def read() -> bytes:
        async for chunk in chunks:
            if chunk:
                return chunk
        return b""

    return read


# Errors that mean "this replica failed us": connection refused/reset, protocol errors.
UPSTREAM_ERRORS = (httpx.HTTPError, aiohttp.ClientError, OSError)
