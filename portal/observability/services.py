"""Writes of the observability app: the queue-depth samples behind the dashboard's chart."""

from __future__ import annotations

import time

from portal.deployments.models import Deployment

from . import metrics
from .collector import live_gauges


def queue_depth_sample(*, at: float | None = None) -> int:
    """Read every served model's queue now and keep the minute's largest total; returns the total."""
    deployments = list(Deployment.objects.values_list("pk", "name", "state", "model_version__name"))
    queues, _inflight = live_gauges(metrics.client(), deployments)
    total = sum(queues.values())
    metrics.minute_max("queue_depth", total, at=time.time() if at is None else at)
    return total
