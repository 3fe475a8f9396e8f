"""A real node agent for tests: `celery worker -Q node.<name>` against the test database.

As `make run` starts one (solo pool, one task at a time), in its own session so a test can stop
it as a crash or an operator would. The servers it starts live in their own sessions too (an agent
restart must not kill them), so stopping the agent stops them here.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import redis
from django.conf import settings
from django.db import connection

from devtools import stop
from inference import supervisor
from tests.helpers import ROOT
from tests.helpers.samples import NVIDIA_SMI


@contextlib.contextmanager
def node_agent(
    node_name: str, log_path: Path, *, also_queues: tuple[str, ...] = (), **extra_env: str
) -> Iterator[subprocess.Popen]:
    """The agent for `node_name` running until the block ends; `extra_env` sets the portal's settings.

    `also_queues` (e.g. `("control",)`) makes the same worker take those queues too, for a test that
    needs a control-side task sent by the agent to run without a second worker."""
    from portal.core.redis.client import redis_keys
    from portal.deployments.models import Deployment

    queue = f"node.{node_name}"
    # Messages an earlier run left on the queue would run first.
    broker = redis.Redis.from_url(settings.CELERY_BROKER_URL)
    for name in (queue, *also_queues):
        broker.delete(redis_keys().celery_key(name))
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
                *("-Q", ",".join((queue, *also_queues)), "-n", f"{node_name}@%h"),
                *("--pool", "solo", "--loglevel", "INFO"),
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
            stop(process, grace_s=60)
            for pgid in Deployment.objects.exclude(pgid=None).values_list("pgid", flat=True):
                supervisor.stop_group(pgid, grace_s=10)


class FakeNvidiaSmi:
    """An `nvidia-smi` (and `dmesg`) on a node agent's PATH that print committed fixtures.

    `show(name)` switches what the next call prints (a file in inference/data/nvidia_smi/), so a test
    can turn a GPU degraded under a running agent; `hang()` makes nvidia-smi stop answering.
    """

    def __init__(self, bin_dir: Path) -> None:
        self.bin_dir = bin_dir
        self.fixtures = NVIDIA_SMI
        bin_dir.mkdir(parents=True, exist_ok=True)
        self._current = bin_dir / "nvidia-smi.current"
        self._kernel_log = bin_dir / "dmesg.current"
        shown = f'shown="$(cat {self._current})"\n'
        self._write("nvidia-smi", shown + '[ "$shown" = hang ] && exec sleep 3600\nexec cat "$shown"\n')
        self._write("dmesg", f'[ -s {self._kernel_log} ] || exit 1\nexec cat "$(cat {self._kernel_log})"\n')
        self._kernel_log.write_text("")

    def _write(self, name: str, body: str) -> None:
        script = self.bin_dir / name
        script.write_text("#!/bin/sh\n" + body)
        script.chmod(0o755)

    def show(self, fixture: str) -> None:
        self._current.write_text(str(self.fixtures / fixture))

    def kernel_log(self, fixture: str) -> None:
        self._kernel_log.write_text(str(self.fixtures / fixture))

    def hang(self) -> None:
        self._current.write_text("hang")

    @property
    def path(self) -> str:
        return f"{self.bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"
