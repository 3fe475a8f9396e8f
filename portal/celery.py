"""The Celery app: Redis broker, a `control` queue, a `benchmarks` queue and one queue per GPU node.

A task meant for a node is sent to `node.<name>`; only the node agent started
on that machine consumes it, so the work (starting vLLM, reading nvidia-smi)
happens where the GPUs are.
"""

from __future__ import annotations

import os

from celery import Celery
from celery.signals import beat_init, worker_ready

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")

app = Celery("portal")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()

CONTROL_QUEUE = "control"
# Benchmarks run for minutes to hours: on their own queue and worker, so a sweep never holds
# up supervision or the usage flush (which share `control`).
BENCHMARK_QUEUE = "benchmarks"


@worker_ready.connect
def _worker_heartbeat(**kwargs) -> None:
    """A worker says which Redis namespace it uses, as web processes do (portal/core/heartbeat.py)."""
    from portal.core.heartbeat import namespace_heartbeat_start

    namespace_heartbeat_start("worker")


@beat_init.connect
def _beat_heartbeat(**kwargs) -> None:
    from portal.core.heartbeat import namespace_heartbeat_start

    namespace_heartbeat_start("beat")


def node_queue(node_name: str) -> str:
    """The queue that the agent on `node_name` consumes."""
    return f"node.{node_name}"
