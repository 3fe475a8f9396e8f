"""What a test that starts processes needs beyond devtools: their environment and an event loop.

Ports, waits and stopping are `devtools` (free_port, wait_for_http, stop, children_of).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os

__all__ = ["run_async", "worker_env"]


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
