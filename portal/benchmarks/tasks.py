"""Benchmark tasks: IDs in, the service does the work. A run goes to the `benchmarks` queue; a
node acceptance to the node's own queue."""

from __future__ import annotations

from celery import shared_task
from celery.signals import worker_ready

from portal.core.tasking import skip_missing_row


# acks_late: a worker that dies mid-run leaves the message to be redelivered; the run's lease
# then lets the new delivery resume after the last saved level, and makes a duplicate a no-op.
@shared_task(name="benchmarks.run", acks_late=True)
@skip_missing_row("benchmarks.BenchmarkRun", arg="run_id")
def run_benchmark(run_id: int) -> None:
    from .services import benchmark_run_execute

    benchmark_run_execute(run_id=run_id)


@shared_task(name="benchmarks.accept_node")
def accept_node(acceptance_id: int) -> str:
    """Run a node acceptance (portal/benchmarks/acceptance/run.py); returns its state.

    Runs on the node itself (sent with `send_to_node`). Not acks_late: a redelivered half-done
    acceptance would start a second reference server; a lost one is marked abandoned after
    ACCEPTANCE_STALE_S and can be requested again.
    """
    from .acceptance.run import node_acceptance_run

    return node_acceptance_run(acceptance_id=acceptance_id).state


@shared_task(name="benchmarks.expire_acceptances")
def expire_acceptances() -> list[int]:
    """Beat: mark acceptances whose agent went silent abandoned, and stop their reference servers."""
    from .acceptance.request import node_acceptances_expire

    return node_acceptances_expire()


@shared_task(name="benchmarks.expire_runs")
def expire_runs() -> list[int]:
    """Beat: end the runs whose worker died (lease lapsed) as failed, or partial with saved levels."""
    from .services import benchmark_runs_expire

    return benchmark_runs_expire()


@worker_ready.connect
def check_gateway_on_start(sender=None, **_kwargs) -> None:
    """The worker that runs members' benchmarks says at start whether BENCHMARK_GATEWAY_URL reaches
    this portal's gateway (issue 38: a portal on 8100 sent every member's run to port 8000)."""
    from portal.celery import BENCHMARK_QUEUE

    try:
        queues = [queue.name for queue in sender.task_consumer.queues]
    except AttributeError:
        return
    if BENCHMARK_QUEUE in queues:
        from .services.gateway_check import benchmark_gateway_check_at_start

        benchmark_gateway_check_at_start()
