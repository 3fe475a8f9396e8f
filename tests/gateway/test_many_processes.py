"""Quotas stay exact across gateway processes: the same limits hold whether one process or several
serve the requests, as `uvicorn --workers 2` (one port, the kernel spreads connections) and as two
servers on two ports (clients alternate between them). Every process runs against the test database
and the real Redis, in front of the fake upstream."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from devtools import free_port, stop, wait_for_http
from tests.helpers import ROOT
from tests.helpers.gateway import (
    REDIS_URL,
    chat_body,
    make_setup,
    upstream_reset,
    upstream_stats,
    wait_for_slots_free,
)
from tests.helpers.processes import run_async

# Several gateway processes at once: out of make test-fast.
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

# A stream that outlives any test: admitted requests hold their slots until the test closes them.
HOLD = "FAKE chunks=600 interval=100"


@dataclass
class Gateways:
    """The web processes of one topology: `urls` are where clients go, `groups` their process groups."""

    topology: str
    urls: list[str]
    processes: list[subprocess.Popen]
    log_paths: list[Path]

    def url(self, i: int) -> str:
        return self.urls[i % len(self.urls)]

    def serving_pids(self) -> dict[int, int]:
        """Established client connections per web process (pid), read from /proc."""
        ports = {int(url.rsplit(":", 1)[1]) for url in self.urls}
        sockets = _established_inodes(ports)
        counts: dict[int, int] = {}
        for pid in _pids_in_groups({p.pid for p in self.processes}):
            try:
                links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
            except (FileNotFoundError, PermissionError, ProcessLookupError):
                continue
            held = sum(1 for link in links if link.startswith("socket:[") and int(link[8:-1]) in sockets)
            if held:
                counts[pid] = held
        return counts


def _established_inodes(ports: set[int]) -> set[int]:
    """Inodes of ESTABLISHED TCP sockets whose local port is one of `ports` (the server side)."""
    inodes: set[int] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            fields = line.split()
            local_port = int(fields[1].rsplit(":", 1)[1], 16)
            if fields[3] == "01" and local_port in ports:
                inodes.add(int(fields[9]))
    return inodes


def _pids_in_groups(groups: set[int]) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except (FileNotFoundError, ProcessLookupError):
            continue
        # pgrp is the 3rd field after the ")" that closes the command name.
        if int(stat.rsplit(")", 1)[1].split()[2]) in groups:
            pids.append(int(entry))
    return pids


def _start(log_path: Path, *, port: int, workers: int) -> subprocess.Popen:
    from django.db import connection

    db = connection.settings_dict
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "DATABASE_URL": f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}",
        "REDIS_URL": REDIS_URL,
        "DATABASE_CONN_MAX_AGE": "0",
        "GATEWAY_CACHE_S": "30",  # revocation must reach every process through Redis, not a cache miss
        "GATEWAY_QUEUE_TIMEOUT_S": "2",
        "GATEWAY_SLOT_LEASE_S": "30",
    }
    with open(log_path, "wb") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "portal.asgi:application", "--port", str(port),
             "--workers", str(workers), "--loop", "uvloop", "--http", "httptools", "--no-access-log",
             "--timeout-graceful-shutdown", "3"],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip


def _wait_started(log_path: Path, process: subprocess.Popen, workers: int, timeout: float = 60) -> None:
    """Until every worker has loaded the application (uvicorn logs this line per worker after it)."""
    deadline = time.monotonic() + timeout
    while log_path.read_text(errors="replace").count("Started server process") < workers:
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(log_path.read_text(errors="replace")[-3000:])
        time.sleep(0.1)


@pytest.fixture(scope="module", params=["workers", "servers"])
def gateways(request, django_db_setup, django_db_blocker, tmp_path_factory):
    """Two gateway processes: `uvicorn --workers 2` on one port, or two servers on two ports."""
    directory = tmp_path_factory.mktemp(f"gateways-{request.param}")
    shapes = [(2, directory / "workers.log")] if request.param == "workers" else [
        (1, directory / "server-1.log"), (1, directory / "server-2.log")
    ]  # fmt: skip
    processes: list[subprocess.Popen] = []
    urls: list[str] = []
    try:
        for workers, log_path in shapes:
            port = free_port()
            processes.append(_start(log_path, port=port, workers=workers))
            urls.append(f"http://127.0.0.1:{port}")
        for (workers, log_path), process, url in zip(shapes, processes, urls, strict=True):
            _wait_started(log_path, process, workers)
            wait_for_http(f"{url}/v1/models", watch=process)
        yield Gateways(request.param, urls, processes, [log for _w, log in shapes])
    finally:
        for process in processes:
            stop(process)


@dataclass
class Burst:
    statuses: list[int]
    codes: list[str]  # the error code of each refused request ("" for a 200)
    serving: dict[int, int]  # connections per web process while every answer was in
    elapsed_s: float


async def _burst(gateways: Gateways, headers: dict, body: dict, n: int) -> Burst:
    """`n` simultaneous requests spread over the processes; admitted streams stay open until every
    request has its answer, so they are simultaneous however slow the machine is."""
    limits = httpx.Limits(max_connections=n + 5, max_keepalive_connections=n + 5)
    async with httpx.AsyncClient(limits=limits, timeout=60) as client:

        async def one(i: int) -> tuple[httpx.Response, str]:
            request = client.build_request(
                "POST", f"{gateways.url(i)}/v1/chat/completions", headers=headers, json=body
            )
            response = await client.send(request, stream=True)
            if response.status_code == 200:
                return response, ""
            await response.aread()
            return response, response.json()["error"]["code"]

        started = time.monotonic()
        answered = await asyncio.gather(*[one(i) for i in range(n)])
        elapsed = time.monotonic() - started
        serving = gateways.serving_pids()
        for response, _code in answered:
            await response.aclose()
    return Burst([r.status_code for r, _ in answered], [c for _, c in answered], serving, elapsed)


def _until_every_process_served(gateways: Gateways, round_: Callable[[], Burst], *, timeout_s: float = 90):
    """Rounds (each checks its own outcome) until every web process has held client connections in one:
    the kernel spreads `--workers` connections unevenly, two servers get alternate clients."""
    want = 2
    seen: set[int] = set()
    deadline = time.monotonic() + timeout_s
    while len(seen) < want:
        assert time.monotonic() < deadline, f"only {len(seen)} of {want} processes served in {timeout_s} s"
        seen |= set(round_().serving)


def test_it_admits_exactly_10_of_50_simultaneous_requests_across_two_processes(
    gateways, team, cpu_node, fake_upstream, gw_redis
):
    team.max_concurrent = 10
    team.save()
    setup = make_setup(team=team, node=cpu_node, upstream=fake_upstream)

    def round_() -> Burst:
        upstream_reset(fake_upstream)
        burst = run_async(_burst(gateways, setup.headers, chat_body(setup.model, HOLD, stream=True), 50))
        assert burst.statuses.count(200) == 10
        assert burst.statuses.count(429) == 40
        assert set(burst.codes) == {"", "rate_limit_exceeded"}
        assert upstream_stats(fake_upstream)["max_in_flight"] == 10
        assert not any(wait_for_slots_free(gw_redis, setup).values())
        return burst

    _until_every_process_served(gateways, round_)


def _rate_round(gateways, setup, body: dict, n: int, *, allowed_at_once: int, per_minute: float) -> Burst:
    """`n` requests at once against a per-minute limit that lets `allowed_at_once` through as a burst and
    refills `per_minute` a minute: what was admitted is within one request of what the clock allows."""
    burst = run_async(_burst(gateways, setup.headers, body, n))
    admitted = burst.statuses.count(200)
    refilled = int(burst.elapsed_s * per_minute / 60)
    assert allowed_at_once <= admitted <= allowed_at_once + refilled + 1, (admitted, burst.elapsed_s)
    assert burst.statuses.count(429) == n - admitted
    assert set(burst.codes) - {""} == {"rate_limit_exceeded"}
    return burst


def test_it_holds_a_requests_per_minute_limit_across_two_processes(
    gateways, team, cpu_node, fake_upstream, gw_redis
):
    def round_() -> Burst:  # a fresh key each round: its limit starts full
        setup = make_setup(team=team, node=cpu_node, upstream=fake_upstream, key_kwargs={"rpm_limit": 12})
        body = chat_body(setup.model, stream=True)
        return _rate_round(gateways, setup, body, 40, allowed_at_once=12, per_minute=12)

    _until_every_process_served(gateways, round_)


def test_it_holds_a_tokens_per_minute_limit_across_two_processes(
    gateways, team, cpu_node, fake_upstream, gw_redis
):
    from portal.gateway.tokens import prompt_tokens

    def round_() -> Burst:  # a fresh key each round: its limit starts full
        setup = make_setup(team=team, node=cpu_node, upstream=fake_upstream)
        body = chat_body(setup.model, HOLD, stream=True, max_tokens=1000)
        # Each request reserves its prompt (estimated: the bundled config has no tokenizer) + max_tokens;
        # 10.5 reservations a minute admit 10 at once (half a request of slack against float rounding).
        reserved = prompt_tokens(body, chat=True, tokenizer_path=None) + 1000
        setup.key.tpm_limit = 10 * reserved + reserved // 2
        setup.key.save()
        # Held open, so no request gives back its unused reservation while the others are admitted.
        return _rate_round(gateways, setup, body, 40, allowed_at_once=10, per_minute=10.5)

    _until_every_process_served(gateways, round_)


def test_it_stops_a_revoked_key_at_the_next_request_in_every_process(
    gateways, team, cpu_node, fake_upstream, gw_redis
):
    from portal.teams.services import api_key_revoke

    setup = make_setup(team=team, node=cpu_node, upstream=fake_upstream)
    body = chat_body(setup.model)

    def served() -> Burst:
        burst = run_async(_burst(gateways, setup.headers, body, 16))
        assert burst.statuses == [200] * 16
        return burst

    def refused() -> Burst:
        burst = run_async(_burst(gateways, setup.headers, body, 16))
        assert burst.statuses == [401] * 16
        # key_disabled: the process's cached row still says usable, Redis's block list refuses it.
        assert set(burst.codes) <= {"key_disabled", "revoked_api_key"}
        return burst

    # Every process has served the key, so each holds its row in its cache (GATEWAY_CACHE_S=30).
    _until_every_process_served(gateways, served)
    api_key_revoke(api_key=setup.key)
    # From the very next request on, every process refuses it.
    _until_every_process_served(gateways, refused)
