"""Node-agent tasks of the registry. They run on the queue of the node that holds the files."""

from __future__ import annotations

from celery import shared_task

from portal.core.tasking import skip_missing_row

HASH_PROGRESS_WRITE_S = 0.5


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
    import time

    from portal.core.errors import ApplicationError

    from .models import ModelVersion
    from .services import model_version_hash_files, model_version_hash_status

    version = ModelVersion.objects.get(pk=version_id)
    last = [0.0]

    def progress(relpath: str, done: int, total: int) -> None:
        # At most two writes a second: a 70B model is thousands of reads, the page refreshes in seconds.
        now = time.monotonic()
        if now - last[0] >= HASH_PROGRESS_WRITE_S or done >= total:
            last[0] = now
            percent = 100 * done / total if total else 100
            model_version_hash_status(model_version=version, status=f"hashing: {percent:.0f} % ({relpath})")

    model_version_hash_status(model_version=version, status="hashing: 0 %")
    try:
        version = model_version_hash_files(model_version=version, progress=progress)
    except ApplicationError as error:
        model_version_hash_status(model_version=version, status=f"not hashed: {error.message}")
        return f"not hashed: {error.message}"
    files = len(version.weight_files) + len(version.tokenizer_files)
    done = f"hashed: {files} files"
    if not version.tokenizer_sha256:
        done += "; no tokenizer files, so it cannot be rolled out"
    model_version_hash_status(model_version=version, status=done)
    return version.weights_sha256
