"""The gateway's ASGI application: `/v1/` served without Django's request handler.

Django's ASGIHandler runs every synchronous middleware method, and the
request_started/request_finished signal receivers, through `sync_to_async`, each a
hop to a worker thread (measured here: ~5.5 ms per request for a cached `/v1/models`).
The gateway needs none of the page middleware (sessions, CSRF, messages, login: it
authenticates by API key), nor Django's request and response machinery around its few
async views: a view reads the method, the body, the path and two or three headers. So
`/v1/` is served by this application: the same URLconf and the same async views, called
with a `GatewayRequest` (those fields, in the names Django's `HttpRequest` gives them, so
the views serve Django's test client and the playground too); no middleware, no
per-request signals, no 4xx log line per refusal (the gateway counts those in its
metrics). It still refuses a Host that ALLOWED_HOSTS does not list, with Django's own
rules. Database connections are used only on cache misses, from `sync_to_async` helpers
that call `close_old_connections` first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

from django.conf import settings
from django.core.exceptions import RequestAborted
from django.http import HttpResponse, HttpResponseBase, QueryDict
from django.http.request import split_domain_port, validate_host
from django.urls import Resolver404, ResolverMatch, URLResolver, get_resolver

from .errors import GatewayError, body_too_large
from .errors import error_response as gateway_error_response
from .sse import RelayResponse

log = logging.getLogger("portal.gateway")


def body_refusal(limit: int) -> tuple[str, bytes]:
    """What portal.core.bodylimit sends for a gateway request over GATEWAY_MAX_BODY_BYTES: the one 413."""
    return "application/json", body_too_large(limit).payload()


class GatewayRequest:
    """What a gateway view reads of its request, under `HttpRequest`'s names. The body was bounded
    by GATEWAY_MAX_BODY_BYTES at the edge (portal.core.bodylimit) while it arrived; `META` holds
    the headers as Django names them (`HTTP_AUTHORIZATION`) and the peer's `REMOTE_ADDR`."""

    __slots__ = ("META", "_query", "body", "method", "path", "query_string", "resolver_match")

    def __init__(self, scope: dict, body: bytes) -> None:
        self.method: str = scope["method"]
        self.path: str = scope["path"]
        self.body = body
        meta = _header_meta(scope["headers"])
        client = scope.get("client")
        meta["REMOTE_ADDR"] = client[0] if client else ""
        server = scope.get("server") or ("localhost", 80)
        meta["SERVER_NAME"], meta["SERVER_PORT"] = server[0], str(server[1])
        self.META: dict[str, str] = meta
        self.resolver_match: ResolverMatch | None = None
        self.query_string: bytes = scope.get("query_string", b"")
        self._query: QueryDict | None = None

    @property
    def GET(self) -> QueryDict:
        """The query string, parsed on first use (the completions routes never read it)."""
        if self._query is None:
            self._query = QueryDict(self.query_string.decode("latin1"))
        return self._query

    @property
    def path_info(self) -> str:
        return self.path

    def host_allowed(self) -> bool:
        """Django's ALLOWED_HOSTS rule (`HttpRequest.get_host`), which CommonMiddleware applies to the
        pages: the Host header (X-Forwarded-Host under USE_X_FORWARDED_HOST), else the server's."""
        meta = self.META
        if settings.USE_X_FORWARDED_HOST and "HTTP_X_FORWARDED_HOST" in meta:
            host = meta["HTTP_X_FORWARDED_HOST"]
        else:
            host = meta.get("HTTP_HOST") or f"{meta['SERVER_NAME']}:{meta['SERVER_PORT']}"
        allowed = settings.ALLOWED_HOSTS
        if settings.DEBUG and not allowed:
            allowed = [".localhost", "127.0.0.1", "[::1]"]
        domain, _port = split_domain_port(host)
        return bool(domain) and validate_host(domain, allowed)


# How long a cancelled view may run on before it is cancelled again.
RECANCEL_S = 0.1


async def cancel_until_done(task: asyncio.Task) -> None:
    """Cancel `task` again until it has ended.

    A library may lose a cancellation: Python 3.11's `asyncio.wait_for`, which redis-py uses
    for its socket timeout, returns the result of a write that completed as the cancel arrived,
    and the view goes on as if its client were still there (seen: a request whose client left
    while queued was sent upstream and billed as completed). Cancelled once more, the view stops
    at its next await, so such a request never reaches (or stays on) a replica.
    """
    while not (await asyncio.wait({task}, timeout=RECANCEL_S))[0]:
        task.cancel()


@dataclass
class _Resolved:
    """The gateway endpoints' URL matches, for one URLconf (tests may swap it)."""

    resolver: URLResolver | None = None
    matches: dict[str, ResolverMatch] = field(default_factory=dict)


_resolved = _Resolved()
MAX_RESOLVED = 16  # its four endpoints, with room to spare


def _header_meta(headers: list[tuple[bytes, bytes]]) -> dict[str, str]:
    """The headers as Django's ASGIRequest puts them in META: `HTTP_<NAME>`, repeated ones joined
    with commas, and a name with an underscore dropped (else `X_Forwarded_For` could pose as
    `X-Forwarded-For`, which the client address and the auth throttle read)."""
    meta: dict[str, str] = {}
    for raw_name, raw_value in headers:
        name = raw_name.decode("latin1")
        if "_" in name:
            continue
        if name == "content-length":
            key = "CONTENT_LENGTH"
        elif name == "content-type":
            key = "CONTENT_TYPE"
        else:
            key = "HTTP_" + name.upper().replace("-", "_")
        value = raw_value.decode("latin1")
        meta[key] = f"{meta[key]},{value}" if key in meta else value
    return meta


class GatewayHandler:
    """The ASGI application of `/v1/` (portal/asgi.py routes it here, behind the body limit)."""

    def resolve(self, request: GatewayRequest) -> ResolverMatch:
        """The gateway's few endpoints are resolved once per process, not per request (the site's
        URLconf is walked pattern by pattern); any other path, the JSON 404, each time."""
        resolver = get_resolver()
        if resolver is not _resolved.resolver:
            _resolved.resolver, _resolved.matches = resolver, {}
        match = _resolved.matches.get(request.path)
        if match is None:
            match = resolver.resolve(request.path)
            # A path with an id in it (`/v1/files/file-…`) is resolved each time: kept, such paths
            # would fill the table and leave the completion routes out.
            if (
                match.url_name != "unknown-path"
                and not match.kwargs
                and len(_resolved.matches) < MAX_RESOLVED
            ):
                _resolved.matches[request.path] = match
        request.resolver_match = match
        return match

    async def get_response(self, request: GatewayRequest) -> HttpResponseBase:
        """The view's response; an error no view caught is logged and answered as a JSON 500."""
        try:
            match = self.resolve(request)
            return await match.func(request, *match.args, **match.kwargs)
        except Resolver404:  # only with a URLconf that lacks the gateway's catch-all (a test's)
            return gateway_error_response(GatewayError(404, "Unknown endpoint.", code="unknown_url"))
        except Exception:
            log.exception("gateway request to %s failed", request.path[:200])
            return gateway_error_response(GatewayError(500, "Internal gateway error.", code="internal_error"))

    async def read_body(self, receive) -> bytes:
        """The body, whole: the edge (portal.core.bodylimit) bounded it by GATEWAY_MAX_BODY_BYTES."""
        parts = []
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise RequestAborted()
            parts.append(message.get("body", b""))
            if not message.get("more_body", False):
                return parts[0] if len(parts) == 1 else b"".join(parts)

    async def listen_for_disconnect(self, receive) -> None:
        """Returns (raising RequestAborted) once the client has gone: uvicorn also says so once
        the response is complete."""
        message = await receive()
        if message["type"] == "http.disconnect":
            raise RequestAborted()
        raise ValueError(f"Invalid ASGI message after the request body: {message['type']}")

    async def send_response(
        self, response: HttpResponseBase, send, on_complete: Callable[[], None] | None = None
    ) -> None:
        """A whole response as one message (with its length); a relayed stream's parts as they come,
        one message each (they are small SSE events). Gateway responses set no cookies.
        `on_complete` is told once a stream's end is sent (its accounting follows)."""
        headers = [(name.encode("ascii"), value.encode("latin1")) for name, value in response.items()]
        if not isinstance(response, RelayResponse):
            content = cast(HttpResponse, response).content  # the gateway's other answers are whole
            headers.append((b"content-length", str(len(content)).encode("ascii")))
            await send({"type": "http.response.start", "status": response.status_code, "headers": headers})
            await send({"type": "http.response.body", "body": content})
            return
        await send({"type": "http.response.start", "status": response.status_code, "headers": headers})
        relay = response.relay
        try:
            async for part in relay:
                await send({"type": "http.response.body", "body": part, "more_body": True})
            await send({"type": "http.response.body"})  # the client has the whole stream now
            if on_complete is not None:
                on_complete()
        finally:
            # The accounting, after the response's end (RelayStream); a stream cut short (the
            # client left, a cancellation) still finishes its exchange here, exactly once.
            await relay.aclose()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            raise ValueError(f"The gateway serves HTTP only, not {scope['type']}.")
        try:
            body = await self.read_body(receive)
        except RequestAborted:
            return
        request = GatewayRequest(scope, body)
        if not request.host_allowed():
            refusal = GatewayError(400, "Invalid Host header.", code="invalid_host")
            await self.send_response(gateway_error_response(refusal), send)
            return

        complete = False

        def completed() -> None:
            nonlocal complete
            complete = True

        async def process_request() -> None:
            response = await self.get_response(request)
            with contextlib.suppress(asyncio.CancelledError):  # the client left while we were sending
                await self.send_response(response, send, completed)

        # A disconnect while the view runs (queued, waiting for upstream, streaming) cancels it.
        tasks = [
            asyncio.create_task(self.listen_for_disconnect(receive)),
            asyncio.create_task(process_request()),
        ]
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in tasks:
            if task.done():
                # A disconnect (uvicorn reports one once the response is complete) is read, not
                # re-raised: raising it here would add this frame to its traceback, and this frame
                # holds `tasks`, which hold the exception: a cycle that kept every request's
                # objects (request, body, relay) alive until a rare full GC pass (perf/soak.py).
                if task.cancelled() or not isinstance(task.exception(), RequestAborted):
                    task.result()
            elif task is tasks[1] and complete:
                # The response is whole (uvicorn then reports a disconnect): what runs now is the
                # stream's accounting, which no client is waiting for. Let it end, uncancelled.
                await task
            else:
                task.cancel()
                if task is tasks[1]:
                    await cancel_until_done(task)
                with contextlib.suppress(asyncio.CancelledError):
                    await task
