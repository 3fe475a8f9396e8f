"""What the bench scripts share: free loopback ports, child processes, the usage flusher, tables."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_redis(port: int, process: subprocess.Popen, timeout: float = 10) -> None:
    """Until the private redis-server on `port` answers PING; SystemExit if it dies or time runs out."""
    import redis

    client = redis.Redis(host="127.0.0.1", port=port)
    deadline = time.monotonic() + timeout
    while True:
        try:
            client.ping()
            return
        except redis.ConnectionError:
            if process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("the private redis-server did not start (see redis.log)") from None
            time.sleep(0.1)
        finally:
            client.close()


def wait_up(url: str, process: subprocess.Popen, timeout: float = 60) -> None:
    """Until `url` answers anything over HTTP; SystemExit if the process dies or time runs out."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"{url}: process exited with {process.returncode}")
        try:
            httpx.get(url, timeout=1)
            return
        except httpx.HTTPError:
            time.sleep(0.2)
    raise SystemExit(f"{url} did not come up")


def spawn(argv: Sequence[str], **kwargs) -> subprocess.Popen:
    """A child in its own process group (so `stop` takes its children too), from the repository root."""
    return subprocess.Popen(list(argv), cwd=ROOT, start_new_session=True, **kwargs)  # noqa: S603


def start(args: Sequence[str], **kwargs) -> subprocess.Popen:
    """`python <args>` with this interpreter."""
    return spawn([sys.executable, *args], **kwargs)


def stop(process: subprocess.Popen, grace_s: float = 10) -> None:
    """SIGTERM the child's process group, SIGKILL it after `grace_s`; never raises."""
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def tear_down(processes: Sequence[subprocess.Popen], directory: Path, *, keep: bool, label: str) -> None:
    """Stop every process, the last started first; remove `directory` unless asked to keep it."""
    for process in reversed(processes):
        stop(process)
    if keep:
        print(f"{label}: kept {directory}", file=sys.stderr)
    else:
        shutil.rmtree(directory, ignore_errors=True)


def flusher_loop(interval_s: float = 2) -> None:
    """The usage flusher (what the Celery beat task does every few seconds), as its own process."""
    import django

    django.setup()
    from portal.teams.services import usage_flush

    while True:
        usage_flush()
        time.sleep(interval_s)


def table(header: Sequence[str], rows: Sequence[Sequence[str]], *, left: Sequence[int] = (0,)) -> str:
    """A Markdown table, columns padded to their widest cell; columns in `left` align left."""
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows, strict=True)]

    def line(cells: Sequence[str]) -> str:
        padded = (
            f"{cell!s:<{w}}" if i in left else f"{cell!s:>{w}}"
            for i, (cell, w) in enumerate(zip(cells, widths, strict=True))
        )
        return "| " + " | ".join(padded) + " |"

    return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])
