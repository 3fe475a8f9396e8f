"""Child processes in their own process groups, their logs in files, stopped whole.

A child started here leads a new session (`start_new_session=True`), so stopping it signals its
group: a server's workers, a Celery worker's pool processes and uvicorn's reloader go with it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any


def spawn(
    argv: Sequence[str],
    *,
    log: Path | None = None,
    cwd: Path | str | None = None,
    env: dict[str, str] | None = None,
    **popen: Any,
) -> subprocess.Popen:
    """Start `argv` as the leader of a new process group.

    With `log`, its stdout and stderr are appended to that file (opened here and closed once the
    child holds it); otherwise `popen` says where they go, as for subprocess.Popen.
    """
    if log is None:
        return subprocess.Popen(list(argv), cwd=cwd, env=env, start_new_session=True, **popen)  # noqa: S603
    with open(log, "ab") as out:
        return subprocess.Popen(  # noqa: S603 - our own argv
            list(argv),
            cwd=cwd,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            **popen,
        )


def _signal_group(process: subprocess.Popen, sig: signal.Signals) -> None:
    # Gone already (reaped, or a group that emptied itself): nothing to signal.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, sig)


def stop_all(
    processes: Iterable[subprocess.Popen], *, grace_s: float = 10.0, kill_wait_s: float = 10.0
) -> list[int | None]:
    """SIGTERM every running process's group at once, SIGKILL any still running after `grace_s`.

    Returns each exit code in order (None for one that outlived SIGKILL by `kill_wait_s`, which
    only an uninterruptible sleep can do); never raises. Signalling all first lets the processes
    shut down side by side, so stopping five costs one grace period, not five.
    """
    processes = list(processes)
    for process in processes:
        if process.poll() is None:
            _signal_group(process, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    codes: list[int | None] = []
    for process in processes:
        try:
            codes.append(process.wait(timeout=max(0.0, deadline - time.monotonic())))
            continue
        except subprocess.TimeoutExpired:
            _signal_group(process, signal.SIGKILL)
        try:
            codes.append(process.wait(timeout=kill_wait_s))
        except subprocess.TimeoutExpired:
            codes.append(None)
    return codes


def stop(process: subprocess.Popen, *, grace_s: float = 10.0, kill_wait_s: float = 10.0) -> int | None:
    """SIGTERM the process's group, SIGKILL it after `grace_s`; its exit code. Never raises."""
    return stop_all([process], grace_s=grace_s, kill_wait_s=kill_wait_s)[0]


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


def log_tail(path: Path | None, lines: int = 40) -> str:
    """The last `lines` lines of a child's log, for a failure report ("(no log)" if there is none)."""
    if path is None or not path.exists():
        return "(no log)"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
