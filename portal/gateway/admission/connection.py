"""One pipelined Redis connection per event loop, for the rate limiter's scripts.

redis-py's asyncio client takes a connection from its pool for each command and wraps the
call in its retry, timeout and parser layers: about 105 µs of CPU per script call here, and
about 420 µs on a request path that the CPU's caches have forgotten (one stream at a time);
this connection, about 52 and 162 µs (docs/decisions.md, "The gateway's own cost, fourth pass").
Redis answers in order, so every call of the event loop shares one connection: each writes
its command and waits for its own reply; hiredis parses them.

The connection is opened by the client's own connection class (so TLS, AUTH, the database,
Sentinel's primary and the connect timeout are the client's), then read here. The client's
policy holds (portal/core/redis/client.py):
- a call waits at most the client's socket timeout for its reply; a timeout closes the
  connection (the replies after it would be out of step) and fails every call on it;
- only refused or broken connections are retried, by the client's own Retry object (a
  timed-out script may have run);
- a primary that has become a replica (`READONLY`, after a Sentinel failover) closes the
  connection, so the retry reconnects to the new primary.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
from collections.abc import Awaitable
from typing import Any

import hiredis
from redis._parsers.base import BaseParser
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import InvalidResponse, NoScriptError, ReadOnlyError
from redis.exceptions import TimeoutError as RedisTimeoutError


class _Replies(asyncio.Protocol):
    """A connection's reader: each reply goes to the oldest call still waiting for one."""

    def __init__(self, transport: asyncio.Transport, reader: hiredis.Reader, writer: object) -> None:
        self.transport = transport
        self.reader = reader
        self.waiting: collections.deque[asyncio.Future] = collections.deque()
        self.closed = False
        # The stream writer redis-py opened the transport with: kept alive, since collecting it would
        # close the transport under us (asyncio's StreamWriter.__del__).
        self._writer = writer

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        try:
            while (reply := self.reader.gets()) is not False:
                waiter = self.waiting.popleft()
                if waiter.done():  # its caller was cancelled or timed out: the reply is dropped
                    continue
                if isinstance(reply, Exception):
                    waiter.set_exception(reply)
                    if isinstance(reply, _Demoted):
                        self.fail(reply)
                        return
                else:
                    waiter.set_result(reply)
        except (InvalidResponse, IndexError) as error:  # broken protocol, or a reply nobody asked for
            self.fail(RedisConnectionError(f"Redis spoke out of turn: {error!r}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.fail(RedisConnectionError("Connection closed by server."))

    def fail(self, error: Exception) -> None:
        """Close the connection and fail every call waiting on it with `error`."""
        self.closed = True
        self.transport.close()
        while self.waiting:
            waiter = self.waiting.popleft()
            if not waiter.done():
                waiter.set_exception(error)


class ScriptConnection:
    """Runs commands (scripts: `register_script`) on one pipelined connection of `client`'s."""

    def __init__(self, client: Redis) -> None:
        self.client = client
        kwargs = client.connection_pool.connection_kwargs
        self.timeout_s: float | None = kwargs.get("socket_timeout")
        self.retry = client.get_retry()
        self._encoding = kwargs.get("encoding", "utf-8") if kwargs.get("decode_responses") else None
        self._replies: _Replies | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._connecting: asyncio.Task | None = None

    def register_script(self, source: str) -> Script:
        return Script(self, source)

    async def execute(self, *args: Any) -> Any:
        """One command's reply; a refused or broken connection is retried by the client's policy."""
        if self.retry is None:
            return await self._once(args)
        return await self.retry.call_with_retry(lambda: self._once(args), _no_cleanup)

    async def _once(self, args: tuple) -> Any:
        replies = self._replies
        loop = asyncio.get_running_loop()
        if replies is None or replies.closed or self._loop is not loop:
            replies = await self._connected(loop)
        waiter = loop.create_future()
        replies.waiting.append(waiter)
        replies.transport.write(hiredis.pack_command(args))
        timer = None
        if self.timeout_s:
            timer = loop.call_later(self.timeout_s, _time_out, replies, waiter)
        try:
            reply = await waiter
        finally:
            if timer is not None:
                timer.cancel()
        return reply

    def send_now(self, args: tuple) -> asyncio.Future | None:
        """Write one command at once, without yielding, and return the future of its reply (under
        the client's socket timeout); None when no connection of this loop is open (then `execute`).
        What this process writes later reaches Redis after it: the gateway writes a stream's finish
        before the stream's end, so the client's next request comes after it."""
        replies = self._replies
        loop = asyncio.get_running_loop()
        if replies is None or replies.closed or self._loop is not loop:
            return None
        waiter = loop.create_future()
        replies.waiting.append(waiter)
        replies.transport.write(hiredis.pack_command(args))
        if self.timeout_s:
            timer = loop.call_later(self.timeout_s, _time_out, replies, waiter)
            waiter.add_done_callback(lambda _waiter: timer.cancel())
        return waiter

    async def _connected(self, loop: asyncio.AbstractEventLoop) -> _Replies:
        """The loop's connection, opened once for every caller waiting on it."""
        if self._loop is not loop:  # a new event loop (tests run one each): the old one's is gone
            self._loop, self._replies, self._connecting = loop, None, None
        if self._connecting is None:
            self._connecting = loop.create_task(self._connect())
            self._connecting.add_done_callback(self._connect_done)
        # Shielded: a caller that is cancelled does not cancel the others' connect.
        return await asyncio.shield(self._connecting)

    def _connect_done(self, task: asyncio.Task) -> None:
        if self._connecting is task:
            self._connecting = None
        if not task.cancelled() and task.exception() is None:
            self._replies = task.result()

    async def _connect(self) -> _Replies:
        connection = self.client.connection_pool.make_connection()
        await connection.connect()  # the client's connect: timeout, retries, TLS, AUTH, SELECT, Sentinel
        writer = connection._writer
        # The transport is this object's now: redis-py's connection lets go of it, so collecting that
        # connection neither warns of nor closes a connection it no longer uses.
        connection._reader = connection._writer = None
        reader = hiredis.Reader(
            protocolError=InvalidResponse, replyError=_reply_error, encoding=self._encoding
        )
        transport = writer.transport
        replies = _Replies(transport, reader, writer)
        transport.set_protocol(replies)
        return replies

    async def aclose(self) -> None:
        if self._replies is not None:
            self._replies.fail(RedisConnectionError("Connection closed by the portal."))
            self._replies = None


class Script:
    """A Lua script run by its SHA1 (EVALSHA), sent whole (EVAL) when Redis does not know it yet."""

    def __init__(self, connection: ScriptConnection, source: str) -> None:
        self.connection = connection
        self.source = source
        self.sha = hashlib.sha1(source.encode(), usedforsecurity=False).hexdigest()  # Redis names scripts so

    async def __call__(self, keys: list | tuple = (), args: list | tuple = ()) -> Any:
        try:
            return await self.connection.execute("EVALSHA", self.sha, len(keys), *keys, *args)
        except NoScriptError:  # a restarted or flushed Redis: EVAL runs it and caches it again
            return await self.connection.execute("EVAL", self.source, len(keys), *keys, *args)

    def send_now(self, keys: list | tuple = (), args: list | tuple = ()) -> Awaitable[Any]:
        """The call, written before this returns when the connection is open (`ScriptConnection.send_now`);
        await the result for its reply. Otherwise (or when the connection breaks before the reply)
        the plain call, with the client's retry policy."""
        waiter = self.connection.send_now(("EVALSHA", self.sha, len(keys), *keys, *args))
        if waiter is None:
            return self(keys, args)
        return self._reply(waiter, keys, args)

    async def _reply(self, waiter: asyncio.Future, keys: list | tuple, args: list | tuple) -> Any:
        try:
            return await waiter
        except NoScriptError:
            return await self.connection.execute("EVAL", self.source, len(keys), *keys, *args)
        except RedisTimeoutError:
            raise  # the script may have run: never sent twice
        except RedisConnectionError:  # broken before the reply: retried as `execute` retries
            return await self(keys, args)


def _reply_error(message: str) -> Exception:
    error = BaseParser.parse_error(message)
    if isinstance(error, ReadOnlyError):
        # A demoted primary: reconnect (through Sentinel) rather than fail every call until restart.
        return _Demoted(message)
    return error


class _Demoted(RedisConnectionError):
    """The server this connection reached is now a replica."""


def _time_out(replies: _Replies, waiter: asyncio.Future) -> None:
    if not waiter.done():
        replies.fail(RedisTimeoutError("Timeout reading from Redis."))


async def _no_cleanup(error: Exception) -> None:
    return None
