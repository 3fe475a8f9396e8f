"""A body over the limit is refused with a 413 before it is read whole, over a real socket to uvicorn.

The client sends a chunked body (no Content-Length) slowly, checking between chunks
whether the server has answered: the 413 must arrive while the client is still
sending, a little past the limit, and the server must then stop reading (the
connection closes, so the client cannot push the rest).
"""

from __future__ import annotations

import json
import select
import socket
import time
from urllib.parse import urlsplit

import pytest

pytestmark = [pytest.mark.django_db(transaction=True)]

GATEWAY_LIMIT = 1024 * 1024  # GATEWAY_MAX_BODY_BYTES of the test gateway (the default)
PAGES_LIMIT = 2_621_440  # DATA_UPLOAD_MAX_MEMORY_SIZE (the default)
CHUNK = 64 * 1024


def _connect(url: str) -> socket.socket:
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=10)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _head(path: str, headers: dict[str, str]) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    raw = b""
    deadline = time.monotonic() + 10
    while b"\r\n\r\n" not in raw and time.monotonic() < deadline:
        raw += sock.recv(65536)
    head, _, body = raw.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines)}
    length = int(headers.get("content-length", 0))
    while len(body) < length and time.monotonic() < deadline:
        body += sock.recv(65536)
    return int(status_line.split()[1]), headers, body


def _send_chunked_until_answered(sock: socket.socket, *, max_bytes: int) -> int:
    """Send 64 KiB chunks, 2 ms apart, until the server answers; returns the body bytes sent by then."""
    sent = 0
    piece = b"x" * CHUNK
    while sent < max_bytes:
        readable, _, _ = select.select([sock], [], [], 0)
        if readable:
            return sent
        sock.sendall(f"{CHUNK:x}\r\n".encode() + piece + b"\r\n")
        sent += CHUNK
        time.sleep(0.002)
    readable, _, _ = select.select([sock], [], [], 5)
    return sent


def _keeps_reading(sock: socket.socket, *, up_to: int) -> int:
    """How many more bytes the client can push before the closed connection refuses them."""
    pushed = 0
    sock.settimeout(5)
    try:
        while pushed < up_to:
            sock.sendall(f"{CHUNK:x}\r\n".encode() + b"y" * CHUNK + b"\r\n")
            pushed += CHUNK
    except (BrokenPipeError, ConnectionResetError, TimeoutError):
        pass
    return pushed


def test_a_chunked_body_over_the_limit_is_refused_before_it_is_sent_whole(gateway, serving):
    sock = _connect(gateway.url)
    sock.sendall(
        _head(
            "/v1/chat/completions",
            {**serving.headers, "Content-Type": "application/json", "Transfer-Encoding": "chunked"},
        )
    )
    total = 64 * GATEWAY_LIMIT  # what the client would send if nobody stopped it
    sent = _send_chunked_until_answered(sock, max_bytes=total)
    status, headers, body = _read_response(sock)
    assert status == 413
    assert json.loads(body)["error"] == {
        "message": f"Request body is over {GATEWAY_LIMIT} bytes.",
        "type": "invalid_request_error",
        "code": "request_too_large",
    }
    assert headers["connection"] == "close"
    # Answered a little past the limit (socket buffers), long before the client was done.
    assert GATEWAY_LIMIT < sent < GATEWAY_LIMIT + 2 * 1024 * 1024, sent
    # The server stopped reading: the rest cannot be pushed through (only kernel buffers fill).
    pushed = _keeps_reading(sock, up_to=total)
    assert pushed < 16 * 1024 * 1024
    sock.close()


def test_a_declared_length_over_the_limit_is_refused_before_any_body(gateway, serving):
    sock = _connect(gateway.url)
    sock.sendall(
        _head(
            "/v1/completions",
            {**serving.headers, "Content-Type": "application/json", "Content-Length": str(10 * 1024**3)},
        )
    )
    status, _headers, body = _read_response(sock)  # no body byte was sent
    assert status == 413
    assert json.loads(body)["error"]["code"] == "request_too_large"
    sock.close()


def test_a_body_at_the_limit_is_still_read(gateway, serving):
    # A valid JSON body padded to exactly the limit gets past the size check (and fails later, as JSON).
    sock = _connect(gateway.url)
    body = b'{"model": "x", "prompt": "' + b"a" * (GATEWAY_LIMIT - 28) + b'"}'
    assert len(body) == GATEWAY_LIMIT
    head = {**serving.headers, "Content-Type": "application/json", "Content-Length": str(len(body))}
    sock.sendall(_head("/v1/completions", head) + body)
    status, _headers, _body = _read_response(sock)
    assert status != 413
    sock.close()


def test_the_pages_and_api_refuse_a_chunked_body_over_their_limit(gateway):
    sock = _connect(gateway.url)
    sock.sendall(_head("/api/v1/plan/", {"Content-Type": "application/json", "Transfer-Encoding": "chunked"}))
    sent = _send_chunked_until_answered(sock, max_bytes=64 * PAGES_LIMIT)
    status, headers, body = _read_response(sock)
    assert status == 413
    assert body.decode() == f"Request body is over {PAGES_LIMIT} bytes.\n"
    assert headers["connection"] == "close"
    assert PAGES_LIMIT < sent < PAGES_LIMIT + 2 * 1024 * 1024, sent
    sock.close()
