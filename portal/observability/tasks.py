"""Beat: sample the gateway's queues for the dashboard's last-hour chart; roll up production latency."""

from __future__ import annotations

from celery import shared_task


@shared_task(name="observability.sample_queues", ignore_result=True)
def sample_queues() -> int:
    from .services import queue_depth_sample

    return queue_depth_sample()


@shared_task(name="observability.latency_rollup", ignore_result=True)
def latency_rollup() -> dict:
    """Store the usage records waiting in Redis, roll up the last minutes per deployment and open or
    close SLA breaches."""
    from portal.teams.services import usage_flush

    from .services import latency_rollup_recent

    usage_flush()
    return latency_rollup_recent()
