"""Step 4: the one shared upstream client.

httpx's API over the aiohttp transport (`httpx_aiohttp`): under many concurrent
streams httpx's default transport reached only ~20 % of direct throughput here,
the aiohttp transport ~80 % (docs/architecture.md#gateway-upstream-client). One client and one transport (one
connection pool) per event loop, with explicit timeouts and pool limits; `read`
is the longest gap allowed between two chunks.

The proxy's requests skip the client's per-request machinery (cookie extraction
through `http.cookiejar`, auth and redirect flows: ~0.4 ms of CPU per request here,
nothing a pass-through needs) and the transport's `handle_async_request` too: `open_stream`
does what that method does (the transport's aiohttp session, its exception mapping, its
response stream) without building an `httpx.Request`, which the transport only reads back
and whose URL httpx parsed again for every request (~40 % of the call's CPU in process).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import aiohttp
import httpx
from django.conf import settings
from httpx_aiohttp import AiohttpTransport, HttpxAiohttpClient
from httpx_aiohttp.transport import AiohttpResponseStream, map_aiohttp_exceptions

_shared: dict[int, tuple[httpx.AsyncClient, AiohttpTransport, aiohttp.ClientTimeout]] = {}
# What the transport says of every answer (it speaks HTTP/1.1 only).
_EXTENSIONS = {"http_version": b"HTTP/1.1"}


def _get() -> tuple[httpx.AsyncClient, AiohttpTransport, aiohttp.ClientTimeout]:
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
        # The transport's mapping of httpx's timeouts onto aiohttp's, built once.
        per_request = aiohttp.ClientTimeout(
            sock_connect=timeout.connect, sock_read=timeout.read, connect=timeout.pool
        )
        found = _shared[id(loop)] = (shared, transport, per_request)
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
    if not isinstance(transport.client, aiohttp.ClientSession):
        transport.client = transport.get_client()
    with map_aiohttp_exceptions():  # aiohttp's errors as httpx's, as the transport raises them
        response = await transport.client.request(
            "POST", str(url), headers=headers, data=body, allow_redirects=False, auto_decompress=False,
            compress=False, timeout=timeout,
        ).__aenter__()  # fmt: skip
    extensions = (
        {**_EXTENSIONS, "reason_phrase": response.reason.encode()} if response.reason else _EXTENSIONS
    )
    return httpx.Response(
        status_code=response.status,
        headers=response.raw_headers,
        stream=AiohttpResponseStream(response),
        extensions=extensions,
    )


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
