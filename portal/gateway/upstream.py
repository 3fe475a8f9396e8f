"""Step 5: the one upstream client: HTTP/1.1 keep-alive connections, parsed by httptools.

A pass-through needs little of a general HTTP client: one POST with a JSON body, the status
and headers of the answer, then its body as the bytes arrive. aiohttp (through httpx's
API) did that here for about 0.3 ms of CPU per request before the first byte and a
rescheduled timer and two stream layers per chunk (docs/decisions.md, "The gateway's own
upstream client"); this module does it with the llhttp parser uvicorn already uses
(`httptools`), one asyncio protocol per connection and a pool per event loop:

- the request is one write of prebuilt bytes (the URL is split once per replica URL);
- the answer's body is handed out as it arrives (`read`: the bytes received so far, b"" at its
  end), with a read timeout armed only while the relay actually waits;
- a connection whose answer was read to its end goes back to the pool (unless either side said
  `Connection: close`); one closed half-read is dropped, so vLLM sees the disconnect and aborts;
- errors are OSError subclasses (`UpstreamError`) and timeouts TimeoutError subclasses, so the
  gateway tells a replica that failed (another may be tried) from one that was slow.

Limits: GATEWAY_MAX_CONNECTIONS connections per process, idle ones included (when all are
taken, an idle one to another replica is closed to make room; else a request waits for one at
most GATEWAY_CONNECT_TIMEOUT_S); idle ones kept GATEWAY_UPSTREAM_IDLE_S, under the engine's own
keep-alive (uvicorn's 5 s), and a reused one that fails before any byte of its answer is retried
once on a fresh connection (docs/decisions.md, "Stale pooled connections").

An upstream is not trusted to speak well (docs/decisions.md, "What the upstream client accepts"):
interim answers (1xx) are skipped, a `101` fails the request, an answer nobody asked for closes
its connection, and a head past GATEWAY_UPSTREAM_MAX_HEAD_BYTES / _MAX_HEADERS or slower than
GATEWAY_UPSTREAM_HEAD_TIMEOUT_S fails the request and closes its connection.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import select
import ssl
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import lru_cache
from urllib.parse import urlsplit

import httptools
from django.conf import settings

from .per_loop import PerLoop
from .upstream_errors import (
    UPSTREAM_ERRORS,
    ConnectTimeout,
    HeadTimeout,
    NameNotResolved,
    PoolTimeout,
    ReadTimeout,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamTooLarge,
)
from .upstream_names import resolve

# The client's errors are named through this module (upstream_errors.py defines them).
__all__ = [
    "UPSTREAM_ERRORS",
    "ConnectTimeout",
    "HeadTimeout",
    "NameNotResolved",
    "PoolTimeout",
    "Read",
    "ReadTimeout",
    "Target",
    "UpstreamError",
    "UpstreamProtocolError",
    "UpstreamResponse",
    "UpstreamTooLarge",
    "open_stream",
    "target",
]

log = logging.getLogger(__name__)

# Body bytes buffered before reading from the socket pauses: a slow client slows the read.
HIGH_WATER = 64 * 1024


class _Stop(Exception):
    """Stops httptools mid-feed: the reason is on the connection (`error`, `unsolicited`)."""


Read = Callable[[], Awaitable[bytes]]


@dataclass(frozen=True)
class Target:
    """A replica URL split once: where to connect and the first lines of every request to it."""

    host: str
    port: int
    tls: bool
    head: bytes  # "POST <path> HTTP/1.1\r\nHost: ...\r\n"

    @property
    def address(self) -> tuple[str, int, bool]:
        return self.host, self.port, self.tls


@lru_cache(maxsize=256)
def target(url: str) -> Target:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UpstreamError(f"not an http(s) URL: {url!r}")
    tls = parts.scheme == "https"
    port = parts.port or (443 if tls else 80)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    default = port == (443 if tls else 80)
    host = parts.hostname if default else f"{parts.hostname}:{port}"
    if ":" in parts.hostname:  # IPv6 literal
        host = f"[{parts.hostname}]" if default else f"[{parts.hostname}]:{port}"
    return Target(parts.hostname, port, tls, f"POST {path} HTTP/1.1\r\nHost: {host}\r\n".encode("latin1"))


class _Connection(asyncio.Protocol):
    """One keep-alive connection and the answer being read on it (httptools calls the `on_` methods)."""

    def __init__(self, pool: _Pool, address: tuple[str, int, bool]) -> None:
        self.pool = pool
        self.address = address
        self.transport: asyncio.Transport  # from connection_made, before the connection is used
        self.loop = asyncio.get_running_loop()
        self.parser = httptools.HttpResponseParser(self)
        # The read timeout: one timer per wait that outlasts it, not one per chunk (`_watch`).
        self.watchdog: asyncio.TimerHandle | None = None
        self.heard_at = 0.0  # loop time of the last bytes from upstream, or of the wait's start
        self.closed = False
        self.busy = True  # a request is on it; an idle one that receives bytes is broken
        self.idle_since = 0.0
        self.reused = False  # taken from the pool (not opened for this request)
        # Bytes arrived after the answer was complete: they belong to no request, so the
        # connection is never used again (its next answer could be this one's leftover).
        self.unsolicited = False
        self._reset()

    def _reset(self) -> None:
        self.headers: dict[str, str] = {}
        self.head_done = False
        self.keep_alive = False  # read when the head is in: llhttp forgets it once the answer ends
        self.complete = False
        self.chunks: collections.deque[bytes] = collections.deque()
        self.buffered = 0
        self.error: BaseException | None = None
        self.waiter: asyncio.Future | None = None
        self.paused = False
        self.write_ready: asyncio.Future | None = None
        self.received = False  # any byte of this request's answer (its interim heads included)
        self.interim = False  # parsing a 1xx head, which precedes the answer and is skipped
        self.head_bytes = 0
        self.header_count = 0  # headers and their bytes, interim heads' included
        self.header_bytes = 0
        self.head_started = 0.0
        if self.watchdog is not None:
            self.watchdog.cancel()
            self.watchdog = None

    # --- asyncio.Protocol ---------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if not self.busy:  # an answer nobody asked for (a server's 408 before it closes): drop it
            self.transport.close()
            self.closed = True
            return
        self.heard_at = now = self.loop.time()
        if not self.head_done:
            if not self.received:
                self.received = True
                self.head_started = now
            self.head_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(UpstreamProtocolError("upstream switched protocols (101)"))
        except httptools.HttpParserError as error:
            if self.error is None and not self.unsolicited:
                self._fail(UpstreamError(f"upstream spoke broken HTTP: {error}"))
        if not self.head_done and self.error is None:
            # Every byte counted so far is head (the head is still open): bound its size and time.
            pool = self.pool
            if self.head_bytes > pool.max_head_bytes:
                self._fail(
                    UpstreamTooLarge(
                        f"upstream's response head is over {pool.max_head_bytes} bytes",
                        code="upstream_head_too_large",
                    )
                )
            elif now - self.head_started > pool.head_timeout_s:
                self._fail(HeadTimeout(f"upstream's response head took over {pool.head_timeout_s} s"))
        if (self.error is not None or self.unsolicited) and not self.closed:
            self.transport.close()
            self.closed = True

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.complete:
            self._fail(UpstreamError("upstream closed the connection before the answer's end"))
        if self.write_ready is not None and not self.write_ready.done():
            self.write_ready.set_result(None)

    def pause_writing(self) -> None:
        self.write_ready = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self.write_ready is not None and not self.write_ready.done():
            self.write_ready.set_result(None)
        self.write_ready = None

    # --- httptools -----------------------------------------------------------------------------
    def on_message_begin(self) -> None:
        if self.complete:  # a second answer to one request: whoever asks next must not get it
            self.unsolicited = True
            log.warning(
                "upstream %s:%s sent an answer nobody asked for; connection closed", *self.address[:2]
            )
            raise _Stop

    def on_header(self, name: bytes, value: bytes) -> None:
        # A head read in one piece is whole before `data_received` can measure it: counted here too.
        self.header_count += 1
        self.header_bytes += len(name) + len(value) + 4
        pool = self.pool
        if self.header_count > pool.max_headers or self.header_bytes > pool.max_head_bytes:
            self._fail(
                UpstreamTooLarge(
                    f"upstream's head is over {pool.max_headers} headers or {pool.max_head_bytes} bytes",
                    code="upstream_head_too_large",
                )
            )
            raise _Stop
        self.headers[name.decode("latin1").lower()] = value.decode("latin1")

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if status < 200:
            if status == 101:  # the connection would now speak another protocol: never relayed
                self._fail(UpstreamProtocolError("upstream switched protocols (101)"))
                raise _Stop
            # 100 Continue, 103 Early Hints…: an interim head (RFC 9110 §15.2); the answer follows.
            self.interim = True
            self.headers = {}
            return
        self.head_done = True
        self.keep_alive = self.parser.should_keep_alive()
        self._wake()

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > HIGH_WATER and not self.paused:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if self.interim:  # the end of an interim head, not of the answer
            self.interim = False
            return
        self.complete = True
        self._wake()

    # --- the answer ----------------------------------------------------------------------------
    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error
        self._wake()

    async def wait(self, ready: Callable[[], bool], timeout_s: float) -> None:
        """Until `ready()` (or an error): a ReadTimeout after `timeout_s` of nothing."""
        if not ready():
            self.heard_at = self.loop.time()  # silence counts from now, or from the next bytes
        while not ready():
            if self.error is not None:
                raise self.error
            self.waiter = waiter = self.loop.create_future()
            if self.watchdog is None:
                self.watchdog = self.loop.call_later(timeout_s, self._watch, timeout_s)
            try:
                await waiter
            finally:
                self.waiter = None

    def _watch(self, timeout_s: float) -> None:
        """The read timeout's timer: expire a wait that heard nothing for `timeout_s`, else look
        again when it would have (bytes arriving only move `heard_at`: no timer per chunk)."""
        self.watchdog = None
        waiter = self.waiter
        if waiter is None or waiter.done():
            return  # not waiting now: the next wait arms it again
        quiet = self.loop.time() - self.heard_at
        if quiet >= timeout_s:
            waiter.set_exception(ReadTimeout("upstream sent nothing in time"))
        else:
            self.watchdog = self.loop.call_later(timeout_s - quiet, self._watch, timeout_s)

    def take(self) -> bytes:
        data = self.chunks.popleft() if len(self.chunks) == 1 else b"".join(self.chunks)
        self.chunks.clear()
        self.buffered = 0
        if self.paused and not self.closed:
            self.paused = False
            self.transport.resume_reading()
        return data


class UpstreamResponse:
    """An answer whose status and headers are in; its body is read with `read` (or `aread`)."""

    __slots__ = ("_conn", "_released", "headers", "status_code")

    def __init__(self, conn: _Connection) -> None:
        self._conn = conn
        self._released = False
        self.status_code: int = conn.parser.get_status_code()
        self.headers: dict[str, str] = conn.headers

    async def read(self) -> bytes:
        """The body bytes received since the last read (waiting for some), b"" at the body's end."""
        conn = self._conn
        if not conn.chunks:
            if conn.complete:
                self._release()
                return b""
            await conn.wait(lambda: bool(conn.chunks) or conn.complete, conn.pool.read_timeout_s)
            if not conn.chunks:
                self._release()
                return b""
        return conn.take()

    async def aread(self, max_bytes: int | None = None) -> bytes:
        """The whole body; past `max_bytes` an UpstreamTooLarge, and the connection is closed."""
        parts = []
        size = 0
        while chunk := await self.read():
            size += len(chunk)
            if max_bytes is not None and size > max_bytes:
                self._conn.unsolicited = True  # never pooled: the rest of the answer is still coming
                self._release()
                log.warning(
                    "upstream %s:%s answered over %s bytes; connection closed",
                    *self._conn.address[:2],
                    max_bytes,
                )
                raise UpstreamTooLarge(
                    f"upstream's answer is over {max_bytes} bytes", code="upstream_too_large"
                )
            parts.append(chunk)
        return b"".join(parts)

    async def aclose(self) -> None:
        """Done with the answer: its connection is reused if the answer was read whole, else closed."""
        self._release()

    def close(self) -> None:
        """`aclose`, without yielding (it never waits)."""
        self._release()

    def _release(self) -> None:
        if not self._released:
            self._released = True
            self._conn.pool.release(self._conn)


class _Pool:
    """The connections of one event loop: idle ones by address, and a bound on how many exist."""

    def __init__(
        self,
        *,
        max_connections: int,
        connect_timeout_s: float,
        read_timeout_s: float,
        idle_s: float = 4.0,
        max_head_bytes: int = 64 * 1024,
        max_headers: int = 100,
        head_timeout_s: float = 10.0,
    ) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.idle_s = idle_s
        self.max_head_bytes = max_head_bytes
        self.max_headers = max_headers
        self.head_timeout_s = head_timeout_s
        self.idle: dict[tuple[str, int, bool], list[_Connection]] = {}
        self.slots = asyncio.Semaphore(max_connections)
        self._tls: ssl.SSLContext | None = None

    async def acquire(self, address: tuple[str, int, bool], *, fresh: bool = False) -> _Connection:
        """A connection to `address`: the most recently idle one, else a new one (`fresh`: new)."""
        idle = self.idle.get(address)
        now = time.monotonic()
        while idle and not fresh:
            conn = idle.pop()
            if not conn.closed and now - conn.idle_since < self.idle_s and _quiet(conn):
                conn.busy = True
                conn.reused = True
                return conn
            self._discard(conn)
        if self.slots.locked():
            # Every connection is taken: one kept idle for another replica makes room first, so
            # idle connections never starve a request to a replica that has none.
            for conns in self.idle.values():
                if conns:
                    self._discard(conns.pop(0))  # the longest idle
                    break
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                await self.slots.acquire()
        except TimeoutError:
            raise PoolTimeout("every upstream connection was busy") from None
        try:
            return await self._connect(address)
        except BaseException:
            self.slots.release()
            raise

    def _discard(self, conn: _Connection) -> None:
        """Close an idle connection and give back its place in the pool."""
        if not conn.closed:
            conn.transport.close()
            conn.closed = True
        self.slots.release()

    async def _connect(self, address: tuple[str, int, bool]) -> _Connection:
        host, port, tls = address
        loop = asyncio.get_running_loop()
        conn = _Connection(self, address)
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                ip = await resolve(loop, host, port)
                await loop.create_connection(
                    lambda: conn,
                    ip,
                    port,
                    ssl=self._tls_context() if tls else None,
                    server_hostname=host if tls else None,
                )
        except TimeoutError:
            raise ConnectTimeout(f"no connection to {host}:{port} in time") from None
        return conn

    def _tls_context(self) -> ssl.SSLContext:
        if self._tls is None:
            self._tls = ssl.create_default_context()
        return self._tls

    def release(self, conn: _Connection) -> None:
        reusable = conn.complete and conn.keep_alive and conn.error is None
        if not (reusable and not conn.closed and not conn.unsolicited):
            if not conn.closed:
                conn.transport.close()
                conn.closed = True
            self.slots.release()
            return
        conn._reset()
        conn.busy = False
        conn.idle_since = time.monotonic()
        self.idle.setdefault(conn.address, []).append(conn)


def _quiet(conn: _Connection) -> bool:
    """No byte and no EOF waits on an idle connection's socket (one poll, once per reuse).

    The loop reads an idle connection's bytes on its next turn (and then closes it), so bytes
    that arrived since its last turn are still in the socket: a leftover answer, or the server's
    close. Either way the connection is not taken."""
    sock = conn.transport.get_extra_info("socket")
    if sock is None:
        return True
    try:
        readable, _, _ = select.select([sock.fileno()], [], [], 0)
    except (OSError, ValueError):
        return False
    return not readable


def _new_pool() -> _Pool:
    return _Pool(
        max_connections=settings.GATEWAY_MAX_CONNECTIONS,
        connect_timeout_s=settings.GATEWAY_CONNECT_TIMEOUT_S,
        read_timeout_s=settings.GATEWAY_READ_TIMEOUT_S,
        idle_s=settings.GATEWAY_UPSTREAM_IDLE_S,
        max_head_bytes=settings.GATEWAY_UPSTREAM_MAX_HEAD_BYTES,
        max_headers=settings.GATEWAY_UPSTREAM_MAX_HEADERS,
        head_timeout_s=settings.GATEWAY_UPSTREAM_HEAD_TIMEOUT_S,
    )


_pools: PerLoop[_Pool] = PerLoop(_new_pool)


def _pool() -> _Pool:
    return _pools.get()


async def open_stream(url: str, body: bytes, request_id: str, api_key: str = "") -> UpstreamResponse:
    """POST `body` (JSON) to upstream; returns once its status and headers are in (body not read).

    `api_key` is the replica's own server key (the client's gateway key never goes upstream).
    A connection error or timeout before that closes the connection; a cancellation too. A
    connection taken from the pool that fails (write error, reset, EOF) before any byte of the
    answer is tried once more on a fresh one: the server closed it idle, so it never saw the
    request (RFC 9112 §9.3.1; docs/decisions.md, "Stale pooled connections").
    """
    where = target(url)
    if "\r" in api_key or "\n" in api_key:
        raise UpstreamError("the replica's server key holds a line break")
    extra = f"Authorization: Bearer {api_key}\r\n" if api_key else ""
    head = (
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        f"X-Request-Id: {request_id}\r\n{extra}\r\n"
    )
    pool = _pool()
    request = where.head + head.encode("latin1") + body
    conn = await pool.acquire(where.address)
    try:
        return await _exchange(pool, conn, request)
    except OSError as error:
        if isinstance(error, TimeoutError) or not conn.reused or conn.received:
            raise
    # The reused connection died unanswered: the only case where sending again is safe.
    return await _exchange(pool, await pool.acquire(where.address, fresh=True), request)


async def _exchange(pool: _Pool, conn: _Connection, request: bytes) -> UpstreamResponse:
    """Write `request` on `conn` and wait for the answer's head; on any failure the connection is closed."""
    response = None
    try:
        conn.transport.write(request)
        if conn.write_ready is not None:  # a large body filled the socket's buffer
            await conn.write_ready
        await conn.wait(lambda: conn.head_done, pool.read_timeout_s)
        response = UpstreamResponse(conn)
        return response
    finally:
        if response is None:  # failed or cancelled before the answer's head: never reused
            conn.complete = False
            pool.release(conn)
