"""The whole stack as `make run` starts it, against the test database: for journeys through it.

uvicorn (pages, admin and the gateway on one port), a Celery worker on `control`,
one on `benchmarks`, the node agent of the local node (`node.local`, PORTAL_LOCAL_NODE=local) and beat,
each a subprocess in its own process group with its log in a file. The vLLM
servers the agent starts run in PORTAL_RUN_DIR (a temporary directory), in
their own process groups; `stop_stack` stops those too, whatever the database
says by then (transactional tests empty it after each test).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import redis

from inference import supervisor
from portal.core.redis.client import redis_keys

ROOT = Path(__file__).resolve().parents[2]
LOCAL_NODE = "local"
# Beat's supervision pass; the default 15 s would make a journey wait for nothing.
SUPERVISE_INTERVAL_S = 5


@dataclass
class Stack:
    url: str  # what the browser and the `openai` client talk to (pages and /v1/ alike)
    run_dir: Path
    logs: dict[str, Path]
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)

    def log_tails(self, lines: int = 60) -> str:
        """The end of every process's log, for a failure report."""
        parts = []
        for name, path in self.logs.items():
            text = path.read_text(errors="replace") if path.exists() else "(no log)"
            tail = "\n".join(text.splitlines()[-lines:])
            parts.append(f"===== {name} ({path}) =====\n{tail}")
        return "\n".join(parts)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def stack_env(*, database: dict, redis_url: str, run_dir: Path) -> dict[str, str]:
    return {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "DATABASE_URL": (
            f"postgres://{database['USER']}@{database['HOST']}:{database['PORT']}/{database['NAME']}"
        ),
        # No idle connection outlives its request or task: the test database is emptied between tests.
        "DATABASE_CONN_MAX_AGE": "0",
        "REDIS_URL": redis_url,
        "CELERY_BROKER_URL": redis_url,
        "CELERY_RESULT_BACKEND": redis_url,
        "GATEWAY_REDIS_URL": redis_url,
        "PORTAL_LOCAL_NODE": LOCAL_NODE,
        "PORTAL_RUN_DIR": str(run_dir),
        "PORTAL_AGENT_STOP_SERVERS_ON_EXIT": "true",
        "DEPLOYMENT_SUPERVISE_INTERVAL_S": str(SUPERVISE_INTERVAL_S),
        "DEPLOYMENT_READY_TIMEOUT_S": "400",
        "DEPLOYMENT_STOP_GRACE_S": "10",
        "DEPLOYMENT_DRAIN_TIMEOUT_S": "5",
        "PYTHONUNBUFFERED": "1",
    }


def clear_gateway_state(redis_url: str) -> None:
    """Forget the gateway's Redis state (slots, queues, usage, blocked keys and teams).

    A new test database numbers keys and teams from 1 again, so a block left by an
    earlier session would refuse this session's key with the same id.
    """
    client = redis.Redis.from_url(redis_url)
    stale = list(client.scan_iter(f"{redis_keys().gateway}*"))
    if stale:
        client.delete(*stale)
    client.close()


def _celery(*args: str) -> list[str]:
    return [sys.executable, "-m", "celery", "-A", "portal", *args, "--loglevel", "INFO"]


def start_stack(*, database: dict, redis_url: str, tmp: Path) -> Stack:
    """Start the five processes and wait until each is ready (raises with their logs if not)."""
    run_dir = tmp / "run"
    run_dir.mkdir(parents=True, exist_ok=True)
    env = stack_env(database=database, redis_url=redis_url, run_dir=run_dir)
    # Messages an earlier run (or another test of this session) left on the queues this stack consumes.
    broker = redis.Redis.from_url(redis_url)
    queues = ("control", "benchmarks", f"node.{LOCAL_NODE}")
    broker.delete(*[redis_keys().celery_key(queue) for queue in queues])
    broker.close()
    clear_gateway_state(redis_url)
    port = _free_port()
    env["BENCHMARK_GATEWAY_URL"] = f"http://127.0.0.1:{port}"  # members' benchmarks go through it
    tag = f"journeys-{os.getpid()}"
    commands = {
        "web": [
            sys.executable, "-m", "uvicorn", "portal.asgi:application",
            "--host", "127.0.0.1", "--port", str(port), "--log-level", "info",
        ],
        "control": _celery(
            "worker", "-Q", "control", "-n", f"control-{tag}@%h", "--pool", "solo",
            "--without-mingle", "--without-gossip",
        ),
        "benchmarks": _celery(
            "worker", "-Q", "benchmarks", "-n", f"benchmarks-{tag}@%h", "--pool", "solo",
            "--without-mingle", "--without-gossip",
        ),
        "agent": _celery(
            "worker", "-Q", f"node.{LOCAL_NODE}", "-n", f"agent-{tag}@%h", "--pool", "solo",
            "--without-mingle", "--without-gossip",
        ),
        "beat": _celery("beat", "--schedule", str(tmp / "celerybeat-schedule")),
    }  # fmt: skip
    stack = Stack(url=f"http://127.0.0.1:{port}", run_dir=run_dir, logs={})
    for name, argv in commands.items():
        log_path = tmp / f"{name}.log"
        stack.logs[name] = log_path
        with open(log_path, "wb") as log:
            stack.processes[name] = subprocess.Popen(
                argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
    try:
        _wait_ready(stack, "web", lambda: _answers(f"{stack.url}/accounts/login/"))
        for name in ("control", "benchmarks", "agent"):
            _wait_ready(stack, name, lambda n=name: " ready." in stack.logs[n].read_text(errors="replace"))
        _wait_ready(stack, "beat", lambda: "beat: Starting" in stack.logs["beat"].read_text(errors="replace"))
    except BaseException:
        stop_stack(stack)
        raise
    return stack


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _wait_ready(stack: Stack, name: str, ready, timeout_s: float = 90) -> None:
    process = stack.processes[name]
    deadline = time.monotonic() + timeout_s
    while not ready():
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited with {process.returncode}:\n{stack.log_tails()}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{name} not ready after {timeout_s:.0f} s:\n{stack.log_tails()}")
        time.sleep(0.3)


def servers_in(run_dir: Path) -> set[int]:
    """Process groups of every process working in run_dir: the servers the agent launched
    (each in its own group, cwd its deployment's directory) and their engine processes."""
    groups = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cwd = os.readlink(f"/proc/{entry}/cwd")
            pgid = os.getpgid(int(entry))
        except OSError:
            continue
        if Path(cwd).is_relative_to(run_dir):
            groups.add(pgid)
    return groups


def stop_servers(run_dir: Path) -> None:
    for pgid in servers_in(run_dir):
        supervisor.stop_group(pgid, grace_s=10, kill_wait_s=10)


def stop_stack(stack: Stack) -> None:
    """SIGTERM every process group (SIGKILL after 20 s), then any server left in the run directory."""
    for process in stack.processes.values():
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
    for process in stack.processes.values():
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)
    stop_servers(stack.run_dir)
