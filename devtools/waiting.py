"""Wait until something answers, with a deadline, failing with what did not answer.

One polling loop (`wait_until`) and two probes on it: a TCP connect and an HTTP request. Each
may watch the processes expected to answer: one that exits fails the wait at once, naming it,
instead of polling a dead server until the deadline.
"""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Callable, Mapping
from typing import TypeVar

T = TypeVar("T")

Watched = subprocess.Popen | Mapping[str, subprocess.Popen] | None


class NotReady(AssertionError):
    """What was awaited did not happen in time, or the process meant to answer exited.

    An AssertionError, so pytest reports a failed wait as a failed expectation, and a test that
    adds context to a failed assertion (`except AssertionError`) adds it here too.
    """


def _exited(watch: Watched) -> str | None:
    if watch is None:
        return None
    processes = {"the process": watch} if isinstance(watch, subprocess.Popen) else watch
    for name, process in processes.items():
        if process.poll() is not None:
            return f"{name} exited with {process.returncode}"
    return None


def wait_until(
    predicate: Callable[[], T],
    *,
    what: str,
    timeout_s: float = 30.0,
    interval_s: float = 0.05,
    watch: Watched = None,
    details: Callable[[], str] | None = None,
) -> T:
    """Poll `predicate` until it returns something truthy, and return that.

    Fails (NotReady) with "not <what> after <timeout_s> s" once the deadline passes, or with
    "not <what>: <name> exited with <code>" as soon as a process in `watch` exits; `details()`
    (a log's tail, say) is appended to either message. The predicate is asked once more at the
    deadline, so a slow machine never fails a wait that just made it.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        exited = _exited(watch)
        if exited is not None:
            raise NotReady(_message(f"not {what}: {exited}", details))
        if time.monotonic() > deadline:
            raise NotReady(_message(f"not {what} after {timeout_s:g} s", details))
        time.sleep(interval_s)


def _message(text: str, details: Callable[[], str] | None) -> str:
    return f"{text}\n{details()}" if details is not None else text


def tcp_answers(host: str, port: int, *, timeout_s: float = 1.0) -> bool:
    """Whether something accepts a TCP connection on host:port now."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def http_answers(url: str, *, status: int | None = None, timeout_s: float = 2.0) -> bool:
    """Whether `url` answers over HTTP now: with any status, or with `status` when given."""
    import httpx

    try:
        answer = httpx.get(url, timeout=timeout_s)
    except httpx.HTTPError:
        return False
    return status is None or answer.status_code == status


def wait_for_tcp(
    host: str,
    port: int,
    *,
    timeout_s: float = 30.0,
    interval_s: float = 0.1,
    watch: Watched = None,
    what: str | None = None,
    details: Callable[[], str] | None = None,
) -> None:
    """Until something accepts connections on host:port."""
    wait_until(
        lambda: tcp_answers(host, port),
        what=what or f"answering on {host}:{port}",
        timeout_s=timeout_s,
        interval_s=interval_s,
        watch=watch,
        details=details,
    )


def wait_for_http(
    url: str,
    *,
    timeout_s: float = 30.0,
    status: int | None = None,
    interval_s: float = 0.1,
    watch: Watched = None,
    what: str | None = None,
    details: Callable[[], str] | None = None,
) -> None:
    """Until `url` answers over HTTP (with `status`, when given; any status otherwise)."""
    wait_until(
        lambda: http_answers(url, status=status),
        what=what or f"answering at {url}" + (f" with {status}" if status is not None else ""),
        timeout_s=timeout_s,
        interval_s=interval_s,
        watch=watch,
        details=details,
    )
