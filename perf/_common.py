"""What the bench scripts share beyond devtools: children from the repository root, a private Redis's
PING, a scratch directory and tearing a world down, the usage flusher, tables."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import devtools
from devtools import wait_until

ROOT = Path(__file__).resolve().parents[1]


def wait_redis(port: int, process: subprocess.Popen, timeout: float = 10) -> None:
    """Until the private redis-server on `port` answers PING (accepting connections is not enough
    once it loads a dataset); NotReady naming it if it dies or time runs out."""
    import redis

    client = redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=1)

    def pong() -> bool:
        try:
            return bool(client.ping())
        except redis.ConnectionError:
            return False

    try:
        wait_until(pong, what=f"the private redis-server answering PING on {port} (see redis.log)",
                   timeout_s=timeout, interval_s=0.1, watch=process)  # fmt: skip
    finally:
        client.close()


def spawn(argv: Sequence[str], **kwargs) -> subprocess.Popen:
    """A child in its own process group (so `stop` takes its children too), from the repository root."""
    return devtools.spawn(argv, cwd=ROOT, **kwargs)


def start(args: Sequence[str], **kwargs) -> subprocess.Popen:
    """`python <args>` with this interpreter."""
    return spawn([sys.executable, *args], **kwargs)


def tear_down(processes: Sequence[subprocess.Popen], directory: Path, *, keep: bool, label: str) -> None:
    """Stop every process, the last started first; remove `directory` unless asked to keep it."""
    for process in reversed(processes):
        devtools.stop(process)
    if keep:
        print(f"{label}: kept {directory}", file=sys.stderr)
    else:
        shutil.rmtree(directory, ignore_errors=True)


@contextlib.contextmanager
def scratch(label: str, *, keep: bool = False) -> Iterator[tuple[Path, list[subprocess.Popen]]]:
    """A temporary directory and the list of the processes a bench starts; on leaving, `tear_down`."""
    directory = Path(tempfile.mkdtemp(prefix=label.replace(" ", "-") + "-"))
    processes: list[subprocess.Popen] = []
    try:
        yield directory, processes
    finally:
        tear_down(processes, directory, keep=keep, label=label)


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
