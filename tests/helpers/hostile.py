"""A hostile upstream: a small HTTP/1.1 server (its own event loop, in a thread, so a test may
block its own loop while the server goes on) whose every answer the test writes itself, to send
what a well-behaved engine never would (interim heads, an answer nobody asked for, a protocol
switch, an endless head).

    async with HostileUpstream(lambda request_id, number: answer(request_id)) as server:
        response = await upstream.open_stream(server.url, body, "team-a-1")

`answer(request_id, number)` gets the request's `X-Request-Id` and its number on its connection
(1, 2, …) and returns what to write: bytes, or a list of bytes, pauses (floats, seconds) and
CLOSE (the connection is closed there); an empty result closes it without a byte.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

CLOSE = "close"
Script = bytes | list[bytes | float | str]
Answer = Callable[[str, int], Script]


def answer(body: bytes, *, status: str = "200 OK", extra_head: bytes = b"") -> bytes:
    """One complete JSON answer."""
    return (
        f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n".encode()
        + extra_head
        + b"\r\n"
        + body
    )


def own_answer(request_id: str) -> bytes:
    """An answer naming the request it answers: a caller that got another's would see it."""
    return answer(f'{{"answers":"{request_id}"}}'.encode())


class HostileUpstream:
    def __init__(self, script: Answer) -> None:
        self.script = script
        self.connections = 0
        self.requests: list[str] = []  # X-Request-Id of every request read, in order
        self.url = ""
        self._server: asyncio.Server | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    async def __aenter__(self) -> HostileUpstream:
        return self.start()

    async def __aexit__(self, *exc) -> None:
        self.stop()

    def start(self) -> HostileUpstream:
        """Serve from a thread of its own (also usable outside an event loop: a gateway's replica)."""
        started = threading.Event()

        def serve() -> None:
            self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self._loop)
            self._server = self._loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", 0))
            started.set()
            self._loop.run_forever()
            self._server.close()
            pending = asyncio.all_tasks(self._loop)  # connections still served: ended, then the loop
            for task in pending:
                task.cancel()
            self._loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            self._loop.close()

        self._thread = threading.Thread(target=serve, daemon=True)
        self._thread.start()
        if not started.wait(10):
            raise RuntimeError("the hostile upstream did not start")
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}/v1/chat/completions"
        return self

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    @property
    def base_url(self) -> str:
        """The server's root, as a replica's endpoint URL."""
        return self.url.removesuffix("/v1/chat/completions")

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        number = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                fields = {
                    line.split(b":", 1)[0].strip().lower(): line.split(b":", 1)[1].strip()
                    for line in head.split(b"\r\n")[1:]
                    if b":" in line
                }
                await reader.readexactly(int(fields.get(b"content-length", b"0")))
                request_id = fields.get(b"x-request-id", b"").decode()
                self.requests.append(request_id)
                number += 1
                script = self.script(request_id, number)
                if not script:
                    return
                for part in [script] if isinstance(script, bytes) else script:
                    if part == CLOSE:
                        return
                    if isinstance(part, float):
                        await asyncio.sleep(part)
                    else:
                        writer.write(part)
                        await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            return
        finally:
            writer.close()
