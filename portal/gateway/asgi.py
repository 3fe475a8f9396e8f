"""The gateway's ASGI handler: Django's, minus what costs a thread hop per request.

Django's ASGIHandler runs every synchronous middleware method, and the
request_started/request_finished signal receivers, through `sync_to_async`, each a
hop to a worker thread, and starts a new thread per request for them
(ThreadSensitiveContext). Measured here: ~5.5 ms per request for a cached
`/v1/models`, most of it those hops. The gateway needs none of the page
middleware (sessions, CSRF, messages, login: it authenticates by API key), so
`/v1/` is served by this handler: the same URLconf, the same async views, no
middleware, no per-request signals; it still refuses a Host that ALLOWED_HOSTS
does not list. Database connections are used only on cache
misses, from `sync_to_async` helpers that call `close_old_connections` first.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
from dataclasses import dataclass, field

from django.core.exceptions import DisallowedHost, RequestAborted
from django.core.handlers.asgi import ASGIHandler, ASGIRequest
from django.core.handlers.exception import convert_exception_to_response
from django.urls import ResolverMatch, URLResolver, get_resolver, set_script_prefix

from .errors import GatewayError, body_too_large
from .errors import error_response as gateway_error_response
from .sse import RelayResponse


def body_refusal(limit: int) -> tuple[str, bytes]:
    """What portal.core.bodylimit sends for a gateway request over GATEWAY_MAX_BODY_BYTES: the one 413."""
    return "application/json", body_too_large(limit).payload()


class GatewayRequest(ASGIRequest):
    """A gateway request, whose body the edge (portal.core.bodylimit) has bounded by
    GATEWAY_MAX_BODY_BYTES while it arrived: read whole, with no second size check (Django's
    DATA_UPLOAD_MAX_MEMORY_SIZE is the pages' limit)."""

    @property
    def body(self) -> bytes:
        if not hasattr(self, "_body"):
            self._body = self._stream.read()
        return self._body


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


class GatewayHandler(ASGIHandler):
    request_class = GatewayRequest

    def load_middleware(self, is_async: bool = False) -> None:
        self._view_middleware = []
        self._template_response_middleware = []
        self._exception_middleware = []
        self._middleware_chain = convert_exception_to_response(self._get_response_async)

    def resolve_request(self, request: GatewayRequest) -> ResolverMatch:
        """The gateway's few endpoints are resolved once per process, not per request (the site's
        URLconf is walked pattern by pattern); any other path, the JSON 404, each time."""
        resolver = get_resolver()
        if resolver is not _resolved.resolver:
            _resolved.resolver, _resolved.matches = resolver, {}
        match = _resolved.matches.get(request.path_info)
        if match is None:
            match = resolver.resolve(request.path_info)
            if match.url_name != "unknown-path" and len(_resolved.matches) < MAX_RESOLVED:
                _resolved.matches[request.path_info] = match
        request.resolver_match = match
        return match

    async def read_body(self, receive) -> io.BytesIO:
        """The body in memory: the edge (portal.core.bodylimit) bounded it by GATEWAY_MAX_BODY_BYTES,
        so Django's spooled temporary file (made for the pages' uploads) is not needed."""
        parts = []
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise RequestAborted()
            parts.append(message.get("body", b""))
            if not message.get("more_body", False):
                return io.BytesIO(b"".join(parts))

    async def send_response(self, response, send) -> None:
        """A relayed stream's parts go to the server as they are: one message each, without
        Django's per-part re-chunking generator (they are small SSE events)."""
        if not isinstance(response, RelayResponse):
            return await super().send_response(response, send)
        headers = [(name.encode("ascii"), value.encode("latin1")) for name, value in response.items()]
        await send({"type": "http.response.start", "status": response.status_code, "headers": headers})
        relay = response.relay
        try:
            async for part in relay:
                await send({"type": "http.response.body", "body": part, "more_body": True})
        finally:
            await relay.aclose()  # as Django's aclosing(): a stream cut short still finishes its exchange
        await send({"type": "http.response.body"})

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            raise ValueError(f"The gateway serves HTTP only, not {scope['type']}.")
        await self.handle(scope, receive, send)

    async def handle(self, scope, receive, send) -> None:
        # Django's handle() without the request signals (see the module docstring).
        try:
            body_file = await self.read_body(receive)
        except RequestAborted:
            return
        set_script_prefix(scope.get("root_path", "") or "")
        request, error_response = self.create_request(scope, body_file)
        if request is None:
            body_file.close()
            await self.send_response(error_response, send)
            return
        try:
            # ALLOWED_HOSTS, which CommonMiddleware checks for the pages: a cheap pure check.
            request.get_host()
        except DisallowedHost:
            body_file.close()
            refusal = GatewayError(400, "Invalid Host header.", code="invalid_host")
            await self.send_response(gateway_error_response(refusal), send)
            return

        async def process_request():
            response = await self.run_get_response(request)
            with contextlib.suppress(asyncio.CancelledError):  # the client left while we were sending
                await self.send_response(response, send)
            return response

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
            else:
                task.cancel()
                if task is tasks[1]:
                    await cancel_until_done(task)
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if not tasks[1].cancelled() and tasks[1].exception() is None:
            for closer in tasks[1].result()._resource_closers:
                closer()
        body_file.close()
