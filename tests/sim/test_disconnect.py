"""A client that closes a stream early is ordinary traffic: the simulator frees the request and logs
one line, not a traceback."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import pytest
from aiohttp import ClientConnectionResetError, ClientPayloadError, web
from aiohttp.test_utils import TestClient, TestServer

from inference.sim.cli import build_parser, engine_from_args
from inference.sim.server import SimServer
from tests.helpers.sim import ARGV, completion


def stream_then_vanish(chat: bool) -> SimServer:
    """Stream a long answer to a client whose connection breaks after the first chunk."""

    async def go() -> SimServer:
        args = build_parser().parse_args(ARGV)
        engine, tokenizer, root = engine_from_args(args)
        server = SimServer(engine, served_model_names=["llama-2-7b"], tokenizer=tokenizer, model_root=root)
        async with TestClient(TestServer(server.app())) as client:
            body = completion(stream=True, max_tokens=2000, ignore_eos=True)
            if chat:
                body = {"model": "llama-2-7b", "messages": [{"role": "user", "content": "Hi"}], **body}
                body.pop("prompt")
            response = await client.post("/v1/chat/completions" if chat else "/v1/completions", json=body)
            with contextlib.suppress(ClientPayloadError):  # the stream ends early: that is the point
                await response.read()
            deadline = asyncio.get_running_loop().time() + 30
            while server.engine.has_work and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.02)
        return server

    return asyncio.run(go())


@pytest.mark.parametrize("chat", [False, True])
def test_it_frees_a_stream_the_client_closed_without_logging_a_traceback(monkeypatch, caplog, chat):
    write = web.StreamResponse.write
    writes = []

    async def breaking_write(self, data):
        # What aiohttp raises once the client's connection is gone.
        writes.append(data)
        if len(writes) > 2:
            raise ClientConnectionResetError("Cannot write to closing transport")
        return await write(self, data)

    monkeypatch.setattr(web.StreamResponse, "write", breaking_write)
    with caplog.at_level(logging.INFO):
        server = stream_then_vanish(chat)
    assert not server.engine.has_work  # the request was aborted, its KV blocks freed
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert any("closed the stream" in r.getMessage() for r in caplog.records)
