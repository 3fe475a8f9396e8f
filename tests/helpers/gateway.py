"""The gateway under test as it runs in production: uvicorn in its own process, against the
test database and the real Redis, in front of a fake OpenAI-compatible upstream
(perf/fake_upstream.py) in another process. A pytest plugin (tests/conftest.py): its fixtures
`fake_upstream`, `gateway`, `gw_redis` and `serving` serve every test package."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import redis

from devtools import NotReady, free_port, stop, wait_for_http
from portal.core.redis.client import redis_keys
from tests.helpers import ROOT, builders

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/15")
# The test gateway's timeouts (see `gateway`), and fake-upstream directives that outlast them.
QUEUE_TIMEOUT_S = 4
UPSTREAM_TIMEOUT_S = 4  # first token, and between reads
OUTLASTS_THE_QUEUE = "FAKE chunks=140 interval=50"  # holds its slot 7 s: 3 s past the queue timeout
BATCH_QUEUE_TIMEOUT_S = 6  # the batch class's own deadline: longer than the interactive one
OUTLASTS_THE_BATCH_QUEUE = "FAKE chunks=180 interval=50"  # holds its slot 9 s: 3 s past it
NO_FIRST_TOKEN_IN_TIME = "FAKE delay=7"  # 3 s past the first-token timeout


def spawn_fake_upstream(interval_ms: int, *extra: str) -> tuple[str, subprocess.Popen]:
    """perf/fake_upstream.py on a free loopback port, up and answering; stop it with `stop()`.
    `extra`: more of its arguments (`--status 401`, `--empty`: a misconfigured replica)."""
    port = free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "perf.fake_upstream",
            "--port",
            str(port),
            "--interval-ms",
            str(interval_ms),
            *extra,
        ],
        cwd=ROOT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    wait_for_http(f"{url}/health", watch=process)
    return url, process


@pytest.fixture(scope="session")
def fake_upstream():
    """A fast streaming upstream: 32 chunks 5 ms apart unless a request says otherwise."""
    url, process = spawn_fake_upstream(5)
    yield url
    stop(process)


@dataclass
class Gateway:
    url: str
    log_path: Path

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")


def start_gateway(log_path: Path, **overrides: str) -> tuple[Gateway, subprocess.Popen]:
    """uvicorn serving portal.asgi against the test database, with the test gateway's settings
    and `overrides` (GATEWAY_SLOT_LEASE_S="3", ...); stop it with `stop(process)`."""
    from django.db import connection

    db = connection.settings_dict
    port = free_port()
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "DATABASE_URL": f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}",
        "REDIS_URL": REDIS_URL,
        "DATABASE_CONN_MAX_AGE": "0",
        "LOG_LEVEL": "DEBUG",  # so the no-secret-in-logs test sees everything the process can log
        "GATEWAY_CACHE_S": "30",  # revocation must work through the cache (tests use fresh model names)
        # Seconds a loaded machine's ordinary requests never take (a real vLLM-CPU answer included);
        # tests that reach a timeout ask for delays well beyond it (QUEUE_WAIT_S and the like).
        "GATEWAY_QUEUE_TIMEOUT_S": str(QUEUE_TIMEOUT_S),
        "GATEWAY_BATCH_QUEUE_TIMEOUT_S": str(BATCH_QUEUE_TIMEOUT_S),
        "GATEWAY_FIRST_TOKEN_TIMEOUT_S": str(UPSTREAM_TIMEOUT_S),
        "GATEWAY_READ_TIMEOUT_S": str(UPSTREAM_TIMEOUT_S),
        "GATEWAY_SLOT_LEASE_S": "30",
        **overrides,
    }
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "portal.asgi:application", "--port", str(port),
             "--log-level", "debug", "--loop", "uvloop", "--http", "httptools"],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_http(
            f"{url}/v1/models", watch=process, details=lambda: log_path.read_text(errors="replace")[-3000:]
        )
    except NotReady:
        stop(process)
        raise
    return Gateway(url, log_path), process


@pytest.fixture(scope="session")
def gateway(django_db_setup, django_db_blocker, tmp_path_factory):
    """uvicorn serving portal.asgi against the test database (one process, as in production)."""
    found, process = start_gateway(tmp_path_factory.mktemp("gateway") / "gateway.log")
    try:
        yield found
    finally:
        stop(process)


@pytest.fixture
def gw_redis():
    """The gateway's Redis, emptied of gateway state (slots, queues, usage) before the test."""
    client = redis.Redis.from_url(REDIS_URL)
    stale = list(client.scan_iter(f"{redis_keys().gateway}*"))
    if stale:
        client.delete(*stale)
    yield client
    client.close()


@dataclass
class Setup:
    team: object
    key: object
    token: str
    model: str
    deployment: object
    upstream: str

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}


@pytest.fixture
def serving(transactional_db, team, cpu_node, fake_upstream, gw_redis):
    """Team "search" with a key for a fresh model served by one deployment on the fake upstream."""
    return make_setup(team=team, node=cpu_node, upstream=fake_upstream)


def make_setup(
    *,
    team,
    node,
    upstream: str,
    cap: int | None = None,
    key_kwargs: dict | None = None,
    max_model_len: int | None = None,
) -> Setup:
    name = f"m-{uuid.uuid4().hex[:8]}"
    version = builders.model_version(name)
    profile = builders.profile(version, name=f"p-{name}", max_model_len=max_model_len)
    deployment = builders.serving_deployment(
        name=f"d-{name}",
        team=team,
        model_version=version,
        profile=profile,
        node=node,
        endpoint_url=upstream,
        cap=cap,
    )
    key, token = builders.api_key(team, models=[name], **(key_kwargs or {}))
    return Setup(team, key, token, name, deployment, upstream)


def add_replica(setup: Setup, *, endpoint_url: str, cap: int | None = None, name: str = ""):
    """Another serving deployment of the setup's model, on another upstream."""
    return builders.serving_deployment(
        name=name or f"r-{uuid.uuid4().hex[:8]}",
        team=setup.team,
        model_version=setup.deployment.model_version,
        profile=setup.deployment.profile,
        node=setup.deployment.node,
        endpoint_url=endpoint_url,
        cap=cap,
    )


def chat_body(model: str, content: str = "Hello there", **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": content}], **extra}


def slots_in_use(client: redis.Redis, setup: Setup) -> dict[str, int]:
    """Members of every concurrency set the request could have held."""
    now_ms = time.time() * 1000
    keys = redis_keys()
    names = {
        "team": keys.concurrency("team", setup.team.pk),
        "key": keys.concurrency("key", setup.key.pk),
        "deployment": keys.inflight(setup.deployment.pk),
        "long": keys.long(setup.deployment.pk),
    }
    return {label: client.zcount(name, now_ms, "+inf") for label, name in names.items()}


def wait_for_slots_free(client: redis.Redis, setup: Setup, timeout: float = 30.0) -> dict[str, int]:
    deadline = time.monotonic() + timeout
    while True:
        held = slots_in_use(client, setup)
        if not any(held.values()) or time.monotonic() > deadline:
            return held
        time.sleep(0.05)


def upstream_stats(upstream: str) -> dict:
    return httpx.get(f"{upstream}/stats").json()


def upstream_reset(upstream: str) -> None:
    httpx.post(f"{upstream}/stats/reset")
