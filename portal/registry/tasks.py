"""Node-agent tasks of the registry. They run on the queue of the node that holds the files."""

from __future__ import annotations

from celery import shared_task


# acks_late: a message whose worker vanished (kill -9, node reboot) is delivered
# again after the broker's visibility timeout. The run is safe to repeat: it
# claims the job only if it is queued or its lease lapsed, and starts clean.
@shared_task(name="registry.convert_model_version", acks_late=True)
def convert_model_version(job_id: int) -> str:
    """Convert a bf16 model version to fp16 and register the copy; returns the job's final state.

    Send it with `queue=node.queue` (`portal.celery.node_queue`) of the node holding the files.
    """
    from .services import conversion_job_run

    return conversion_job_run(job_id=job_id).state
