"""Beat: sample the gateway's queues for the dashboard's last-hour chart."""

from __future__ import annotations

from celery import shared_task


@shared_task(name="observability.sample_queues", ignore_result=True)
def sample_queues() -> int:
    from .services import queue_depth_sample

    return queue_depth_sample()
