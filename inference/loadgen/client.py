"""The one streaming client: one OpenAI-compatible request, streamed and timed into a `RequestRecord`.

The load generator (`inference.loadgen.loadgen`), the soak (`perf/soak.py`) and the proxy
benchmark (`perf/proxy_bench.py`) all send their requests through `stream_request`, so a
request is timed, checked and described the same way everywhere. It is modelled on vLLM's
benchmarks/backend_request_func.py (one input, one async function, one output record) and
times a request exactly as `inference.loadgen.summary` describes:
- the clock starts just before the HTTP request;
- every SSE chunk with a non-empty `choices` list is a token event, except a chat chunk whose
  delta carries only the role (the server's preamble, not a token);
- output tokens come from the server's `usage` chunk; a server that sends none (no
  `stream_options.include_usage`) is counted one token per event;
- a stream must end with `[DONE]`; with `expected_output_tokens` (forced lengths: `ignore_eos`
  and `max_tokens`) it must also carry exactly that many tokens.

Errors read "kind: detail" (`RequestRecord.error_kind` is the kind), e.g.
"HTTP 429 rate_limit_exceeded: Rate limit ...", "client timeout: after 120 s",
"connection error (ClientOSError): ...", "stream ended without [DONE]".

aiohttp, not httpx: httpx's default transport is the bottleneck under many concurrent
streams (docs/architecture.md#gateway-upstream-client).
"""

from __future__ import annotations

import asyncio
import codecs
import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from inference.loadgen.summary import RequestRecord

ERROR_BODY_CHARS = 200


@dataclass
class RequestInput:
    """What to send: the full endpoint URL (…/v1/completions or …/v1/chat/completions) and its body.

    `body` may be pre-encoded JSON (bytes), so a caller sending thousands of requests a second
    encodes each distinct body once. `prompt_tokens` is the caller's count, replaced by the
    server's `usage` when it sends one.
    """

    url: str
    body: dict[str, Any] | bytes
    headers: dict[str, str] = field(default_factory=dict)
    timeout_s: float | None = 600.0
    prompt_tokens: int = 0
    expected_output_tokens: int | None = None


def completion_body(
    model: str, prompt: str, *, max_tokens: int, chat: bool = False, usage: bool = True
) -> dict[str, Any]:
    """A streamed request with its output length forced (`ignore_eos` + `max_tokens`; vLLM accepts it)."""
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    body["stream"] = True
    if usage:
        body["stream_options"] = {"include_usage": True}
    return body


async def stream_request(
    session: aiohttp.ClientSession, request: RequestInput, record: RequestRecord | None = None
) -> RequestRecord:
    """Stream one request into `record` (a new one when None) and return it.

    Never raises but CancelledError (the record then says "cancelled", unless it already
    holds an error, and is re-raised so the caller's cancellation goes through).
    """
    record = record if record is not None else RequestRecord(start=0.0)
    record.prompt_tokens = request.prompt_tokens
    body = request.body if isinstance(request.body, bytes) else json.dumps(request.body).encode()
    headers = {"Content-Type": "application/json", **request.headers}
    stream = _Stream(record)
    record.start = time.perf_counter()
    try:
        async with asyncio.timeout(request.timeout_s):
            async with session.post(request.url, data=body, headers=headers) as response:
                record.status = response.status
                if response.status != 200:
                    record.error = _http_error(response.status, await response.read(), response.reason)
                    return record
                async for chunk in response.content.iter_any():
                    stream.feed(chunk)
                stream.close()
        stream.check(request.expected_output_tokens)
    except asyncio.CancelledError:
        record.error = record.error or "cancelled"
        raise
    except TimeoutError:
        record.error = f"client timeout: after {request.timeout_s:g} s"
    except (aiohttp.ClientError, OSError) as error:
        record.error = f"connection error ({type(error).__name__}): {error}".removesuffix(": ")
    except ValueError as error:  # json.JSONDecodeError and UnicodeDecodeError are ValueErrors
        record.error = f"unreadable stream: {error}"
    finally:
        record.end = time.perf_counter()
    return record


def _http_error(status: int, raw: bytes, reason: str | None) -> str:
    """'HTTP 429 rate_limit_exceeded: message' from an OpenAI-style error body, else the raw body."""
    text = raw.decode("utf-8", "replace").strip()
    try:
        error = json.loads(text).get("error")
    except (ValueError, AttributeError):
        error = None
    if isinstance(error, dict):
        code = _error_code(error)
        message = str(error.get("message") or "")
        head = f"HTTP {status} {code}".strip()
        return f"{head}: {message[:ERROR_BODY_CHARS]}" if message else head
    detail = text[:ERROR_BODY_CHARS] or reason or ""
    return f"HTTP {status}: {detail}" if detail else f"HTTP {status}"


def _error_code(error: dict[str, Any]) -> str:
    """The error's name: the gateway's string `code`, else its `type` (vLLM's `code` repeats the status)."""
    code = error.get("code")
    if isinstance(code, str) and code:
        return code
    return str(error.get("type") or code or "")


class _Stream:
    """Server-sent events into a record; an event may arrive split over reads."""

    def __init__(self, record: RequestRecord) -> None:
        self.record = record
        self.decoder = codecs.getincrementaldecoder("utf-8")()
        self.buffer = ""
        self.done = False
        self.events = 0
        self.usage = False

    def feed(self, data: bytes) -> None:
        self.buffer += self.decoder.decode(data)
        if "\n\n" not in self.buffer:
            return
        # SSE events end with a blank line; keep an incomplete tail for the next read.
        *events, self.buffer = self.buffer.split("\n\n")
        for event in events:
            self._event(event.strip())

    def close(self) -> None:
        self.buffer += self.decoder.decode(b"", final=True)
        if self.buffer.strip():
            self._event(self.buffer.strip())
        self.buffer = ""

    def _event(self, event: str) -> None:
        if not event or event.startswith(":"):
            return
        data = event.removeprefix("data:").strip()
        if data == "[DONE]":
            self.done = True
            return
        message = json.loads(data)
        record = self.record
        if choices := message.get("choices"):
            delta = choices[0].get("delta") if isinstance(choices[0], dict) else None
            role_only = isinstance(delta, dict) and not any(v for k, v in delta.items() if k != "role")
            if role_only and isinstance(delta, dict) and "role" in delta:
                return  # the chat preamble ({"role": "assistant", "content": ""}): no token yet
            record.token_times.append(time.perf_counter())
            self.events += 1
        elif usage := message.get("usage"):
            self.usage = True
            record.output_tokens = int(usage.get("completion_tokens") or 0)
            if usage.get("prompt_tokens") is not None:
                record.prompt_tokens = int(usage["prompt_tokens"])
        elif (error := message.get("error")) is not None:
            if isinstance(error, dict):
                code = _error_code(error)
                detail = error.get("message") or ""
            else:
                code, detail = "", str(error)
            kind = f"stream error event {code}".strip()
            record.error = record.error or (f"{kind}: {detail}" if detail else kind)

    def check(self, expected: int | None) -> None:
        record = self.record
        if not self.usage:
            record.output_tokens = self.events
        if record.error is not None:
            return
        if not self.done:
            record.error = "stream ended without [DONE]"
        elif not record.token_times:
            record.error = "stream ended without a token"
        elif expected is not None and record.output_tokens != expected:
            record.error = f"stream incomplete: {record.output_tokens} of {expected} tokens"
