"""Step 5 helper: pass an upstream SSE stream through byte for byte, reading usage on the way.

Chunks are not parsed: a chunk made of whole events that carries no usage object is
sent on as it came. Only an event containing `"usage": {` is decoded, to read the
token counts, and dropped when the client did not ask for usage (the gateway always
asks upstream for it, to account).
"""

from __future__ import annotations

import asyncio
import json
import logging

from django.http import StreamingHttpResponse

from portal.teams.models import UsageStatus

from . import timing
from .errors import GatewayError, error_event
from .upstream import UPSTREAM_ERRORS, Read

log = logging.getLogger("portal.gateway")

SEP = b"\n\n"
MAX_BUFFER = 1 << 20  # an "event" this long without a separator is not SSE: pass it on


def _has_usage(data: bytes) -> bool:
    return b'"usage":{' in data or b'"usage": {' in data


def _role_only(event: bytes) -> bool:
    """A chat stream's opening event (`"delta":{"role":"assistant","content":""}`): no token."""
    return b'"role":' in event and (b'"content":""' in event or b'"content": ""' in event)


class SseRelay:
    def __init__(self, *, strip_usage: bool) -> None:
        self.strip_usage = strip_usage
        self.usage: dict | None = None
        self.events = 0
        self.non_token_events = 0  # the role-only opening event and `[DONE]`
        self._buffer = b""

    def _count(self, complete: bytes) -> None:
        """Count whole events; note the ones that carry no token, for the estimate."""
        if not self.events and _role_only(complete.split(SEP, 1)[0]):
            self.non_token_events += 1
        self.events += complete.count(SEP)
        if complete.endswith(b"[DONE]" + SEP):
            self.non_token_events += 1

    def feed(self, chunk: bytes) -> bytes:
        """The bytes to send for this upstream chunk (whole events; a partial one waits)."""
        if not self._buffer and chunk.endswith(SEP) and not _has_usage(chunk):
            self._count(chunk)
            return chunk
        data = self._buffer + chunk
        end = data.rfind(SEP)
        if end < 0:
            if len(data) > MAX_BUFFER:
                self._buffer = b""
                return data
            self._buffer = data
            return b""
        self._buffer = data[end + 2 :]
        complete = data[: end + 2]
        if not _has_usage(complete):
            self._count(complete)
            return complete
        out = []
        for event in complete.split(SEP)[:-1]:
            self.events += 1
            if _has_usage(event) and self._read_usage(event) and self.strip_usage:
                continue
            out.append(event + SEP)
        return b"".join(out)

    def _read_usage(self, event: bytes) -> bool:
        """Record the usage of an event; True if it is the usage-only chunk (no choices)."""
        for line in event.split(b"\n"):
            if line.startswith(b"data:"):
                try:
                    payload = json.loads(line[5:])
                except ValueError:
                    return False
                if isinstance(payload, dict) and isinstance(payload.get("usage"), dict):
                    self.usage = payload["usage"]
                    return not payload.get("choices")
        return False

    def tail(self) -> bytes:
        rest, self._buffer = self._buffer, b""
        return rest

    def estimated_completion_tokens(self) -> int:
        """The number of token events seen (one token each, as vLLM streams them): what a stream
        cut mid-way (no usage chunk, no `[DONE]`), or one whose usage is not believed, is billed."""
        return max(0, self.events - self.non_token_events)


class RelayStream:
    """The response body of a streamed request: upstream chunks through `SseRelay`, then the
    exchange finishes exactly once, however the stream ends.

    A stream that ends well (upstream's body ended) ends its iteration first and finishes its
    exchange in `aclose`, which the server calls in a `finally` once the response's end is sent:
    the client has `[DONE]` and the end of the body before the accounting (Redis: slots, tokens,
    the usage record) runs, not after it (issue 39: that work showed as ~8 ms at the end of every
    stream to a client timing whole streams). A stream cut short finishes at once, as before.

    A class rather than an async generator so that cancellation (client disconnect)
    reaches `__anext__` directly, Django's `aclosing()` reaches `aclose`, and a stream
    that is never iterated at all (the client left between the view returning and the
    first send) still finishes, from `__del__`.
    """

    def __init__(self, exchange, read: Read, first: bytes, *, strip_usage: bool) -> None:
        self.exchange = exchange
        self.relay = SseRelay(strip_usage=strip_usage)
        self._read = read  # the upstream body's next bytes (b"" at its end), already past `first`
        self._pending: bytes | None = first
        self._done = False  # the exchange has finished (or is finishing)
        # How the stream ended, when upstream's body ended: the exchange finishes so in `aclose`.
        self._ended: tuple[UsageStatus, int] | None = None
        self._billed = False
        self._loop = asyncio.get_running_loop()

    def __aiter__(self):
        return self

    async def __anext__(self) -> bytes:
        if self._done or self._ended is not None:
            raise StopAsyncIteration
        if timing.ON:
            timing.relay_asked()
        try:
            while True:
                if self._pending is not None:
                    chunk, self._pending = self._pending, None
                    if timing.ON:
                        timing.lap("response start")
                else:
                    chunk = await self._read()
                    if not chunk:
                        # The finish script is written now, so it reaches Redis before the client
                        # can send anything more; its reply is awaited in `aclose`, after the end.
                        self._ended = (UsageStatus.COMPLETED, 200)
                        self._bill()
                        if timing.ON:
                            timing.skip()
                        self.exchange.finish_soon(*self._ended)
                        if timing.ON:
                            timing.lap("accounting")
                        tail = self.relay.tail()
                        if tail:
                            return tail
                        raise StopAsyncIteration
                if timing.ON:
                    timing.chunk_arrived()
                out = self.relay.feed(chunk)
                if out:
                    if timing.ON:
                        timing.chunk_relayed()
                    return out
        except StopAsyncIteration:
            raise
        except asyncio.CancelledError:
            await self._end(UsageStatus.CLIENT_CANCELLED, 499, "client_disconnected")
            raise
        except TimeoutError:
            error = GatewayError(504, "Upstream stopped sending tokens.", code="upstream_timeout")
            await self._end(UsageStatus.TIMEOUT, 504, error.code)
            return error_event(error)
        except Exception as exc:
            if not isinstance(exc, UPSTREAM_ERRORS):
                log.exception("stream of request %s failed", self.exchange.request_id)
            error = GatewayError(502, "Upstream failed mid-stream.", code="upstream_error")
            await self._end(UsageStatus.UPSTREAM_ERROR, 502, error.code)
            return error_event(error)

    def _bill(self) -> None:
        """What the exchange bills, from the stream's usage (or its events), once."""
        if self._billed:
            return
        self._billed = True
        ex = self.exchange
        try:
            # The upstream's numbers are not trusted (Exchange.bill_upstream bounds them); whatever
            # they hold, the exchange finishes, or its slots would be renewed for ever.
            ex.bill_upstream(self.relay.usage, completion_estimate=self.relay.estimated_completion_tokens())
        except Exception:
            log.exception("usage of request %s could not be read", ex.request_id)

    async def _end(self, status: UsageStatus, http_status: int, code: str = "") -> None:
        if self._done:
            return
        self._done = True
        try:
            self._bill()
            if timing.ON:
                timing.skip()
        finally:
            # Shielded itself: a cancellation cannot cut it.
            await self.exchange.finish(status, http_status, code)
        if timing.ON:
            timing.lap("accounting")
            timing.done()

    async def aclose(self) -> None:
        """Finish the exchange, once: as the stream ended, or, cut short, as the client's leaving."""
        if self._ended is not None:
            await self._end(*self._ended)
        else:
            await self._end(UsageStatus.CLIENT_CANCELLED, 499, "client_disconnected")

    def __del__(self) -> None:
        if not self._done and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._loop.create_task, self.aclose())


class RelayResponse(StreamingHttpResponse):
    """A streaming response whose body is a RelayStream of bytes, handed to the server as is
    (no per-chunk wrapper generators: the parts are bytes already)."""

    def __init__(self, stream: RelayStream, **kwargs) -> None:
        super().__init__(stream, **kwargs)
        self.relay = stream

    def __aiter__(self):
        return self.relay
