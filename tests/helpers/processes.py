"""Subprocesses a test starts (servers on free loopback ports) and the event loop it may need."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx

from perf._common import free_port

__all__ = ["children_of", "engine_groups", "free_port", "run_async", "stop", "wait_until_up", "worker_env"]


def run_async(coro):
    """Run a coroutine on a fresh event loop in its own thread: a test thread may already have a
    running loop (Playwright's sync API keeps one once the browser tests have run)."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def wait_until_up(url: str, process: subprocess.Popen, timeout: float = 30) -> None:
    """Until `url` answers at all; fails at once if `process` exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{url}: process exited with {process.returncode}")
        try:
            httpx.get(url, timeout=1)
            return
        except httpx.HTTPError:
            time.sleep(0.1)
    raise RuntimeError(f"{url} did not come up in {timeout} s")


def stop(process: subprocess.Popen) -> None:
    """SIGTERM the process's group (it was started with `start_new_session=True`), then SIGKILL."""
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def children_of(pid: int) -> list[int]:
    """The processes whose parent is `pid` (a Celery worker's pool processes), read from /proc."""
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                stat = Path(f"/proc/{entry.name}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def worker_env(**extra: str) -> dict[str, str]:
    """The environment of a Celery worker a test starts: this test's settings, database and broker."""
    from django.conf import settings
    from django.db import connection

    database = connection.settings_dict
    return dict(
        os.environ,
        DJANGO_SETTINGS_MODULE="tests.settings",
        DATABASE_URL=f"postgres://{database['USER']}@{database['HOST']}:{database['PORT']}/{database['NAME']}",
        CELERY_BROKER_URL=settings.CELERY_BROKER_URL,
        CELERY_RESULT_BACKEND=settings.CELERY_RESULT_BACKEND,
        **extra,
    )


def engine_groups(run_dir: Path) -> dict[int, list[int]]:
    """Every live engine process started in the test's run directory, by process group."""
    groups: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            cwd = os.readlink(f"/proc/{entry.name}/cwd")
            state = Path(f"/proc/{entry.name}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if cwd.startswith(str(run_dir)) and state != "Z":
            groups.setdefault(os.getpgid(int(entry.name)), []).append(int(entry.name))
    return groups
