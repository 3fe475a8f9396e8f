"""A real node agent for tests: `celery worker -Q node.<name>` against the test database.

As `make run` starts one (solo pool, one task at a time), in its own session so a test can stop
it as a crash or an operator would. The servers it starts live in their own sessions too (an agent
restart must not kill them), so stopping the agent stops them here.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import redis
from django.conf import settings
from django.db import connection

from inference import supervisor

ROOT = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def node_agent(node_name: str, log_path: Path, **extra_env: str) -> Iterator[subprocess.Popen]:
    """The agent for `node_name` running until the block ends; `extra_env` sets the portal's settings."""
    from portal.core.redis_client import redis_keys
    from portal.deployments.models import Deployment

    queue = f"node.{node_name}"
    # Messages an earlier run left on the queue would run first.
    redis.Redis.from_url(settings.CELERY_BROKER_URL).delete(redis_keys().celery_key(queue))
    db = connection.settings_dict
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "DATABASE_URL": f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}",
        "PORTAL_RUN_DIR": settings.PORTAL_RUN_DIR,
        "DEPLOYMENT_READY_TIMEOUT_S": "400",
        "DEPLOYMENT_STOP_GRACE_S": "20",
        "CELERY_VISIBILITY_TIMEOUT": "7200",
        **extra_env,
    }
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [
                *(sys.executable, "-m", "celery", "-A", "portal", "worker"),
                *("-Q", queue, "-n", f"{node_name}@%h", "--pool", "solo", "--loglevel", "INFO"),
            ],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            yield process
        finally:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=60)
            for pgid in Deployment.objects.exclude(pgid=None).values_list("pgid", flat=True):
                supervisor.stop_group(pgid, grace_s=10)


def wait_for_row(predicate, *, timeout_s: float, what: str, interval_s: float = 0.2) -> None:
    """Poll `predicate` (a database read) until it holds; fail naming `what` after `timeout_s`."""
    import time

    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(interval_s)
