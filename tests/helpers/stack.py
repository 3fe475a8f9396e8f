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
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import redis

from devtools import free_port, log_tail, spawn, stop_all, wait_for_http, wait_until
from inference import supervisor
from portal.core.redis.client import redis_keys

ROOT = Path(__file__).resolve().parents[2]
LOCAL_NODE = "local"
# Beat's supervision pass; the default 15 s would make a journey wait for nothing.
SUPERVISE_INTERVAL_S = 5
READY_TIMEOUT_S = 90


@dataclass
class Stack:
    url: str  # what the browser and the `openai` client talk to (pages and /v1/ alike)
    run_dir: Path
    logs: dict[str, Path]
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)

    def log_tails(self, lines: int = 60) -> str:
        """The end of every process's log, for a failure report."""
        return "\n".join(
            f"===== {name} ({path}) =====\n{log_tail(path, lines)}" for name, path in self.logs.items()
        )


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
    port = free_port()
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
        log_path.unlink(missing_ok=True)
        stack.processes[name] = spawn(argv, log=log_path, cwd=ROOT, env=env)
    try:
        wait_for_http(f"{stack.url}/accounts/login/", status=200, what="web answering", **_watching(stack))
        for name in ("control", "benchmarks", "agent"):
            _wait_logged(stack, name, " ready.")
        _wait_logged(stack, "beat", "beat: Starting")
    except BaseException:
        stop_stack(stack)
        raise
    return stack


def _watching(stack: Stack) -> dict:
    """A wait that fails at once when any of the stack's processes exits, with every log's tail."""
    return {"watch": stack.processes, "timeout_s": READY_TIMEOUT_S, "details": stack.log_tails}


def _wait_logged(stack: Stack, name: str, line: str) -> None:
    wait_until(
        lambda: line in stack.logs[name].read_text(errors="replace"),
        what=f"{name} ready ({line.strip()!r} in its log)",
        interval_s=0.3,
        **_watching(stack),
    )


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
    stop_all(stack.processes.values(), grace_s=20)
    stop_servers(stack.run_dir)
