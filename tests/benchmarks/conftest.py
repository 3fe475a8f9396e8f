"""Benchmark fixtures: the deterministic fake server on a real port; a serving deployment using it."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import pytest
from aiohttp import web

from devtools import free_port
from inference.loadgen.fake_server import FakeServer
from tests.helpers.builders import make_serving_deployment

MODEL = "llama-2-7b-chat-hf"


class RunningFakeServer:
    """A FakeServer served from its own event loop in a background thread."""

    def __init__(self, server: FakeServer) -> None:
        self.server = server
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()
        assert self.ready.wait(10), "fake server did not start"

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        runner = web.AppRunner(self.server.app(), access_log=None)
        self.loop.run_until_complete(runner.setup())
        self.loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", self.port).start())
        self.runner = runner
        self.ready.set()
        self.loop.run_forever()
        self.loop.run_until_complete(runner.cleanup())
        self.loop.close()

    def stop(self) -> None:
        if not self.thread.is_alive():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def fake_server_factory() -> Callable[..., RunningFakeServer]:
    started: list[RunningFakeServer] = []

    def start(**options) -> RunningFakeServer:
        options.setdefault("model", MODEL)
        options.setdefault("first_token_s", 0.02)
        options.setdefault("token_interval_s", 0.002)
        running = RunningFakeServer(FakeServer(**options))
        started.append(running)
        return running

    yield start
    for running in started:
        running.stop()


@pytest.fixture
def fake_server(fake_server_factory) -> RunningFakeServer:
    return fake_server_factory()


@pytest.fixture
def deployment(team, llama7b, profile_tp8, dgx, fake_server):
    return make_serving_deployment(
        team=team, model=llama7b, profile=profile_tp8, node=dgx, url=fake_server.url
    )
