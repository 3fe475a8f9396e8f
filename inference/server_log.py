"""An inference server's log file: kept across launches, rotated while it runs, read back in part.

`launch` (inference/supervisor.py) opens the log O_APPEND and hands the descriptor to the server;
these keep that file bounded without touching the process: `retire_log` before a launch,
`rotate_log` (copy-truncate) while it runs, `log_tail` for what the portal shows. No Django.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def _shift_logs(path: Path, keep: int) -> None:
    """path.{keep-1} → path.{keep}, …, path.1 → path.2 (what was path.{keep} is dropped)."""
    for n in range(keep - 1, 0, -1):
        older = path.with_name(f"{path.name}.{n}")
        if older.exists():
            older.replace(path.with_name(f"{path.name}.{n + 1}"))


def retire_log(path: str | Path, *, keep: int) -> None:
    """Before a launch: the previous run's log becomes path.1 (older ones shift, `keep` kept)."""
    path = Path(path)
    if not path.exists():
        return
    if keep <= 0:
        path.unlink()
        return
    _shift_logs(path, keep)
    path.replace(path.with_name(f"{path.name}.1"))


def rotate_log(path: str | Path | None, *, max_bytes: int, keep: int) -> bool:
    """Copy-truncate the live log of a running server once it is over `max_bytes`.

    The server writes through a descriptor it inherited (opened O_APPEND by `launch`), so the
    file cannot be renamed under it; instead its content is copied to path.1 (older copies
    shift, `keep` kept) and the file truncated: with O_APPEND the next write lands at the new
    end, without a hole. Lines written between the copy and the truncate are lost (as with
    logrotate's copytruncate). Returns whether it rotated.
    """
    if not path:
        return False
    path = Path(path)
    try:
        if path.stat().st_size <= max_bytes:
            return False
    except OSError:
        return False
    if keep > 0:
        _shift_logs(path, keep)
        partial = path.with_name(f"{path.name}.rotating")
        with open(path, "rb") as source, open(partial, "wb") as copy:
            shutil.copyfileobj(source, copy, 1024 * 1024)
        partial.replace(path.with_name(f"{path.name}.1"))
    os.truncate(path, 0)
    return True


def log_tail(path: str | Path | None, *, lines: int = 80, max_bytes: int = 64 * 1024) -> str:
    """The last lines of a log file ("" when it does not exist)."""
    if not path:
        return ""
    try:
        with open(path, "rb") as log:
            log.seek(0, os.SEEK_END)
            size = log.tell()
            log.seek(max(0, size - max_bytes))
            data = log.read()
    except OSError:
        return ""
    text = data.decode("utf-8", errors="replace")
    return "\n".join(text.splitlines()[-lines:])
