"""Which portal this process runs: the version in pyproject.toml and the git commit, read once.

A node agent reports both with its heartbeat, so the node page shows an agent left on old code.
"""

from __future__ import annotations

import functools
import os
import subprocess
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@functools.cache
def portal_version() -> str:
    try:
        version: str = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
        return version
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        return ""


@functools.cache
def portal_commit() -> str:
    """PORTAL_COMMIT when set (an install without .git), else `git rev-parse --short HEAD`, else ""."""
    if os.environ.get("PORTAL_COMMIT"):
        return os.environ["PORTAL_COMMIT"][:40]
    try:
        done = subprocess.run(  # noqa: S603
            ["git", "-C", str(ROOT), "rev-parse", "--short=12", "HEAD"],  # noqa: S607
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout.strip()[:40] if done.returncode == 0 else ""
