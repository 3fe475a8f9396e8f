"""Node-agent tasks of the registry. They run on the queue of the node that holds the files."""

from __future__ import annotations

from celery import shared_task

from portal.core.tasking import skip_missing_row


# acks_late: a message whose worker vanished (kill -9, node reboot) is delivered
# again after the broker's visibility timeout. The run is safe to repeat: it
# claims the job only if it is queued or its lease lapsed, and starts clean.
@shared_task(name="registry.convert_model_version", acks_late=True)
@skip_missing_row("registry.ConversionJob", arg="job_id")
def convert_model_version(job_id: int) -> str | None:
    """Convert a bf16 model version to fp16 and register the copy; returns the job's final state.

    Send it with `queue=node.queue` (`portal.celery.node_queue`) of the node holding the files.
    """
    from .services import conversion_job_run

    return conversion_job_run(job_id=job_id).state


@shared_task(name="registry.hash_model_version")
@skip_missing_row("registry.ModelVersion", arg="version_id")
def hash_model_version(version_id: int) -> str | None:
    """Hash the version's files on this node and record them as its release hashes.

    Send it with `queue=node.queue` of the node holding the files. A missing directory is
    returned (and logged by the worker), not raised: there is nothing to retry.
    """
    from portal.core.errors import ApplicationError

    from .models import ModelVersion
    from .services import model_version_hash_files

    version = ModelVersion.objects.get(pk=version_id)
    try:
        version = model_version_hash_files(model_version=version)
    except ApplicationError as error:
        return f"not hashed: {error.message}"
    return version.weights_sha256
