"""The SLA operating point of a run (the highest level within its SLA) and, for staff, making it
the deployment's gateway concurrency cap."""

from __future__ import annotations

from inference.loadgen.sla import Sla, operating_point
from portal.core.errors import ApplicationError
from portal.deployments.models import Deployment
from portal.deployments.services import deployment_set_concurrency_cap

from ..models import BenchmarkRun


def benchmark_run_pick_sla(run: BenchmarkRun) -> tuple[int | None, str]:
    """(the highest level meeting the run's SLA, or None; why) from the levels saved so far."""
    levels = [level.results for level in run.levels.all()]
    return operating_point(levels, Sla(run.sla_p95_ttft_s, run.sla_p95_tpot_s))


def benchmark_run_apply_sla_cap(*, run: BenchmarkRun, user) -> Deployment:
    """Staff: make the run's SLA operating point the deployment's gateway concurrency cap."""
    if not user.is_staff:
        raise ApplicationError("only staff may change a deployment's gateway cap", field="deployment")
    if run.deployment is None:
        raise ApplicationError("this run is not tied to a deployment", field="deployment")
    if run.sla_concurrency is None:
        raise ApplicationError(
            f"run {run.pk} has no SLA operating point: {run.sla_reason}", field="sla_concurrency"
        )
    source = (
        f"benchmark run {run.pk} ({run.created_at:%Y-%m-%d %H:%M} UTC, mix {run.mix}): "
        f"{run.sla_concurrency} is the highest level meeting {run.sla_text}; applied by {user.username}"
    )
    return deployment_set_concurrency_cap(
        deployment=run.deployment, cap=run.sla_concurrency, source=source[:255]
    )
