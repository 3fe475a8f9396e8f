"""The one streaming client against scripted servers (real HTTP on localhost, in-process)."""

from __future__ import annotations

import asyncio
import json

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer

from inference.loadgen.client import RequestInput, completion_body, stream_request
from inference.loadgen.summary import RequestRecord


def _sse(*messages: dict | str) -> list[bytes]:
    return [f"data: {m if isinstance(m, str) else json.dumps(m)}\n\n".encode() for m in messages]


def _chunk(text: str) -> dict:
    return {"choices": [{"index": 0, "delta": {"content": text}}]}


ROLE = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}


def _stream(pieces: list[bytes], *, status: int = 200, body: bytes = b"") -> RequestRecord:
    """Serve `pieces` one write each (or an error `status` with `body`) and stream one request."""

    async def handler(request: web.Request) -> web.StreamResponse:
        await request.read()
        if status != 200:
            return web.Response(status=status, body=body, content_type="application/json")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for piece in pieces:
            await response.write(piece)
        return response

    async def main() -> RequestRecord:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", handler)
        async with TestServer(app, host="127.0.0.1") as server, aiohttp.ClientSession() as session:
            request = RequestInput(
                url=str(server.make_url("/v1/chat/completions")),
                body=completion_body("m", "hi", max_tokens=3, chat=True),
                prompt_tokens=7,
                expected_output_tokens=3,
            )
            return await stream_request(session, request)

    return asyncio.run(main())


def test_it_times_a_chat_stream_without_counting_the_role_preamble_as_a_token():
    record = _stream(_sse(ROLE, _chunk("a"), _chunk("b"), _chunk("c"), "[DONE]"))
    assert record.ok and record.error is None and record.status == 200
    assert len(record.token_times) == 3
    assert record.output_tokens == 3  # no usage chunk: one token per event
    assert record.prompt_tokens == 7
    assert record.start < record.token_times[0] <= record.end


def test_it_takes_token_counts_from_usage_and_reads_events_split_across_writes():
    usage = {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 3}}
    whole = b"".join(_sse(_chunk("ab"), _chunk("c"), usage, "[DONE]"))
    record = _stream([whole[:5], whole[5:40], whole[40:]])
    assert record.ok
    assert len(record.token_times) == 2 and record.output_tokens == 3 and record.prompt_tokens == 9


def test_it_fails_a_stream_cut_before_done_or_short_of_its_forced_length():
    cut = _stream(_sse(_chunk("a"), _chunk("b"), _chunk("c")))
    assert cut.error == "stream ended without [DONE]" and not cut.ok
    short = _stream(_sse(_chunk("a"), "[DONE]"))
    assert short.error == "stream incomplete: 1 of 3 tokens"
    assert short.error_kind == "stream incomplete"


def test_it_names_an_http_refusal_by_its_code_and_keeps_the_message():
    error = {"message": "slow down", "type": "rate_limit", "code": "rate_limit_exceeded"}
    body = json.dumps({"error": error})
    record = _stream([], status=429, body=body.encode())
    assert record.status == 429
    assert record.error == "HTTP 429 rate_limit_exceeded: slow down"
    assert record.error_kind == "HTTP 429 rate_limit_exceeded"


def test_it_records_an_error_event_in_the_stream():
    event = {"error": {"message": "engine died", "type": "InternalServerError", "code": 500}}
    record = _stream(_sse(_chunk("a"), event, "[DONE]"))
    assert record.error == "stream error event InternalServerError: engine died"


def test_it_reports_a_refused_connection_without_raising():
    async def main() -> RequestRecord:
        async with aiohttp.ClientSession() as session:
            # Port 9 (discard) on localhost: nothing listens there.
            request = RequestInput(url="http://127.0.0.1:9/v1/completions", body=b"{}", timeout_s=5)
            return await stream_request(session, request)

    record = asyncio.run(main())
    assert record.error_kind.startswith("connection error") and not record.ok
    assert record.end is not None
