"""Private services for fault tests: a Redis and a PostgreSQL cluster of the test's own, which it
may stop, kill and restart. The machine's shared PostgreSQL (:5432) and Redis (:6379) are never
touched by a fault: other test runs use them.

Also the web process as production runs it (uvicorn serving pages and the gateway) with an
environment of the test's choosing.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import redis

from devtools import NotReady, free_port, stop, wait_for_http, wait_until
from tests.helpers import ROOT
from tests.helpers.plugin import skip_or_fail_in_ci

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"


def require(condition: bool, message: str) -> None:
    """Skip a fault test whose tool is missing here; in CI a missing tool is a failure."""
    if not condition:
        skip_or_fail_in_ci(message)


# --- Redis ------------------------------------------------------------------------------------


@dataclass
class PrivateRedis:
    """`redis-server` on a port of its own, without persistence: a restart loses every key,
    as a Redis restarted without its dump would."""

    port: int
    log_path: Path
    process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        log = self.log_path.open("ab")
        argv = [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1"]
        self.process = subprocess.Popen(
            [*argv, "--save", "", "--appendonly", "no"],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        client = redis.Redis(port=self.port, socket_connect_timeout=0.5)

        def pong() -> bool:
            try:
                return bool(client.ping())
            except redis.RedisError:
                assert self.process.poll() is None, self.log_path.read_text()[-2000:]
                return False

        wait_until(pong, timeout_s=10, what=f"Redis answering on {self.port}")
        client.close()

    def kill(self, sig: int = signal.SIGKILL) -> None:
        self.process.send_signal(sig)
        if sig in (signal.SIGKILL, signal.SIGTERM):
            self.process.wait(timeout=10)

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port)


@pytest.fixture
def private_redis(tmp_path):
    require(Path(REDIS_SERVER).exists(), f"no redis-server at {REDIS_SERVER}")
    server = PrivateRedis(free_port(), tmp_path / "redis.log")
    server.start()
    yield server
    if server.process is not None and server.process.poll() is None:
        server.process.send_signal(signal.SIGCONT)  # in case a test left it stopped
        server.kill(signal.SIGKILL)


# --- PostgreSQL ---------------------------------------------------------------------------------


def _pg_bin(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    versioned = sorted(Path("/usr/lib/postgresql").glob(f"*/bin/{name}"))
    for candidate in [Path("/usr/local/bin") / name, *versioned]:
        if candidate.exists():
            return str(candidate)
    return None


@dataclass
class PrivateCluster:
    """A PostgreSQL cluster in a temporary directory, trust auth, on 127.0.0.1:`port`.

    PostgreSQL refuses to run as root, so as root the cluster runs as the `postgres` user."""

    port: int
    data_dir: Path
    pg_ctl: str
    as_user: list[str] = field(default_factory=list)

    @property
    def log_path(self) -> Path:
        return self.data_dir.parent / "postgres.log"

    def url(self, database: str) -> str:
        return f"postgres://postgres@127.0.0.1:{self.port}/{database}"

    def ctl(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run(
            [*self.as_user, self.pg_ctl, "-D", str(self.data_dir), "-l", str(self.log_path), "-w", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=True,
        )

    def start(self) -> None:
        options = f"-p {self.port} -k {self.data_dir.parent} -c listen_addresses=127.0.0.1 -c fsync=off"
        self.ctl("-o", options, "start")

    def restart(self) -> float:
        """`pg_ctl restart -m fast`: every client connection is terminated; seconds it took."""
        began = time.monotonic()
        self.ctl("-m", "fast", "restart")
        return time.monotonic() - began

    def stop(self) -> None:
        self.ctl("-m", "immediate", "stop")


@pytest.fixture
def private_postgres():
    initdb, pg_ctl = _pg_bin("initdb"), _pg_bin("pg_ctl")
    require(initdb is not None and pg_ctl is not None, "no initdb/pg_ctl to run a private PostgreSQL")
    as_user: list[str] = []
    base = Path(tempfile.mkdtemp(prefix="faults-pg-"))
    if os.geteuid() == 0:
        require(shutil.which("runuser") is not None, "root needs runuser to run PostgreSQL as postgres")
        try:
            import pwd

            pwd.getpwnam("postgres")
        except KeyError:
            require(False, "no `postgres` user to run a private PostgreSQL as")
        as_user = ["runuser", "-u", "postgres", "--"]
        shutil.chown(base, "postgres")
    data_dir = base / "data"
    subprocess.run(
        [*as_user, initdb, "-D", str(data_dir), "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync"],
        capture_output=True,
        check=True,
        timeout=120,
    )
    cluster = PrivateCluster(free_port(), data_dir, pg_ctl, as_user)
    cluster.start()
    try:
        yield cluster
    finally:
        with contextlib.suppress(subprocess.SubprocessError):
            cluster.stop()
        shutil.rmtree(base, ignore_errors=True)


# --- The web process -------------------------------------------------------------------------


@dataclass
class Web:
    url: str
    process: subprocess.Popen
    log_path: Path

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")


def start_web(log_path: Path, env: dict[str, str]) -> Web:
    """uvicorn serving portal.asgi (pages and `/v1/`), as production does."""
    port = free_port()
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "portal.asgi:application", "--port", str(port),
             "--loop", "uvloop", "--http", "httptools"],
            cwd=ROOT,
            env={**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings", **env},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    web = Web(f"http://127.0.0.1:{port}", process, log_path)
    try:
        wait_for_http(f"{web.url}/v1/models", watch=process, details=lambda: web.log_text()[-3000:])
    except NotReady:
        stop(process)
        raise
    return web


def shared_database_url() -> str:
    from django.db import connection

    db = connection.settings_dict
    return f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}"


def sse_events(response: httpx.Response) -> list[str]:
    return [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
