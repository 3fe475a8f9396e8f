"""The benchmark job: IDs in, the service does the work. Runs on the `control` queue."""

from __future__ import annotations

from celery import shared_task

from portal.core.tasking import skip_missing_row


# acks_late: a worker that dies mid-run leaves the message to be redelivered; the run's lease
# then lets the new delivery resume after the last saved level, and makes a duplicate a no-op.
@shared_task(name="benchmarks.run", acks_late=True)
@skip_missing_row("benchmarks.BenchmarkRun", arg="run_id")
def run_benchmark(run_id: int) -> None:
    from .services import benchmark_run_execute

    benchmark_run_execute(run_id=run_id)
