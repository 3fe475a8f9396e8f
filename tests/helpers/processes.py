"""What a test that starts processes needs beyond devtools: their environment and an event loop.

Ports, waits and stopping are `devtools` (free_port, wait_for_http, stop, children_of).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
from pathlib import Path

__all__ = ["engine_groups", "run_async", "worker_env"]


def run_async(coro):
    """Run a coroutine on a fresh event loop in its own thread: a test thread may already have a
    running loop (Playwright's sync API keeps one once the browser tests have run)."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


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
