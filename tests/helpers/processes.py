"""Subprocesses a test starts (servers on free loopback ports) and the event loop it may need."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import signal
import subprocess
import time

import httpx

from perf._common import free_port

__all__ = ["free_port", "run_async", "stop", "wait_until_up"]


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
