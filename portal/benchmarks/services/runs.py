"""Queueing a benchmark run (one per user at a time) and asking it to stop.

The run is sent to its own `benchmarks` queue by task name, as node work is sent with
portal.inventory.dispatch: no service imports a tasks module (tests/core/test_repository.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from django.contrib.auth import get_user_model
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from inference.errors import InputError
from inference.loadgen.sla import Sla
from inference.loadgen.workloads import load_mix
from portal.celery import BENCHMARK_QUEUE, app
from portal.core.errors import ApplicationError
from portal.deployments.models import Deployment, DeploymentState

from ..models import BenchmarkRun, RunKind, RunState
from .execution import benchmark_run_end_unheld
from .limits import check_bounds, level_plans, plan_to_dict
from .snapshot import deployment_snapshot, deployment_tokenizer_path

# portal/benchmarks/tasks.py `run_benchmark`: the job's body is `benchmark_run_execute`.
RUN_TASK = "benchmarks.run"


@dataclass(frozen=True, kw_only=True)
class BenchmarkRunRequest:
    """What a user asks to measure: a serving deployment, or (staff only) any endpoint and model.

    `mix` is a preset, `fixed:<in>:<out>` or inline JSON, never a file: this is what HTTP reaches.
    Without `requests_per_level` or `duration_s`, each level measures 64 requests.
    """

    deployment: Deployment | None = None
    endpoint_url: str = ""
    model_name: str = ""
    mix: str = "field-mix"
    concurrencies: list[int] = field(default_factory=list)
    request_rates: list[float] = field(default_factory=list)
    requests_per_level: int | None = None
    duration_s: float | None = None
    warmup: int | None = None
    seed: int = 0
    level_timeout_s: float | None = None
    tokenizer: str = ""
    title: str = ""


def _active_run(user) -> BenchmarkRun | None:
    """The user's run that is queued, or running under a live lease (a dead worker's run does not count)."""
    live = Q(state=RunState.QUEUED) | Q(state=RunState.RUNNING, lease_expires_at__gte=timezone.now())
    return BenchmarkRun.objects.filter(live, created_by=user, kind=RunKind.MEASURED).order_by("pk").first()


def _send_run(run_id: int) -> None:
    """Send the job by name to the `benchmarks` queue; in eager mode (CELERY_TASK_ALWAYS_EAGER,
    which `send_task` ignores) run it here, as `apply_async` did."""
    if app.conf.task_always_eager:
        app.loader.import_default_modules()  # autodiscovery, which a worker would have done
        app.tasks[RUN_TASK].apply(args=(run_id,))
    else:
        app.send_task(RUN_TASK, args=[run_id], queue=BENCHMARK_QUEUE)


def benchmark_run_create(*, user, run_request: BenchmarkRunRequest) -> BenchmarkRun:
    """Queue a benchmark of a serving deployment (or, staff only, of any endpoint) on the benchmarks queue.

    A user has one run queued or running at a time.
    """
    asked = run_request
    try:
        mix_object = load_mix(asked.mix)
    except InputError as error:
        raise ApplicationError.from_input_error(error) from error
    mix_definition = mix_object.to_dict()
    # What the history filters by: the preset or fixed spec, or the inline mix's name (marked).
    mix_label = f"json:{mix_object.name}" if asked.mix.strip().startswith("{") else mix_object.name
    requests_per_level = asked.requests_per_level
    if requests_per_level is None and asked.duration_s is None:
        requests_per_level = 64
    deployment = asked.deployment
    level_timeout_s = check_bounds(
        user=user,
        deployment=deployment,
        concurrencies=list(asked.concurrencies or []),
        request_rates=list(asked.request_rates or []),
        requests_per_level=requests_per_level,
        duration_s=asked.duration_s,
        level_timeout_s=asked.level_timeout_s,
        seed=asked.seed,
    )
    plans = level_plans(
        concurrencies=asked.concurrencies,
        request_rates=asked.request_rates,
        requests_per_level=requests_per_level,
        duration_s=asked.duration_s,
        warmup=asked.warmup,
    )
    endpoint_url, model_name, tokenizer = asked.endpoint_url, asked.model_name, asked.tokenizer
    snapshot: dict = {}
    profile = None
    sla = Sla()
    if deployment is not None:
        if deployment.state != DeploymentState.SERVING or not deployment.endpoint_url:
            raise ApplicationError(
                f"{deployment.name} is {deployment.state}, not serving: nothing to benchmark",
                field="deployment",
            )
        endpoint_url = deployment.endpoint_url
        model_name = deployment.model_version.name
        profile = deployment.profile
        snapshot = deployment_snapshot(deployment)
        sla = Sla(deployment.sla_p95_ttft_s, deployment.sla_p95_tpot_s)
        tokenizer = tokenizer or deployment_tokenizer_path(deployment)
    else:
        if not user.is_staff:
            raise ApplicationError(
                "only staff may benchmark an endpoint outside a deployment", field="deployment"
            )
        if not endpoint_url or not model_name:
            raise ApplicationError(
                "give a deployment, or an endpoint URL and a model name", field="endpoint_url"
            )
    config = {
        # What the run is bound to: it measures this deployment or nothing (`execution._engine_target`).
        "deployment_id": deployment.pk if deployment is not None else None,
        "levels": [plan_to_dict(plan) for plan in plans],
        "seed": asked.seed,
        "level_timeout_s": level_timeout_s,
        "tokenizer": tokenizer,
    }
    with transaction.atomic():
        # The user's row is the lock: two requests at once cannot both find no active run.
        get_user_model().objects.select_for_update().filter(pk=user.pk).first()
        active = _active_run(user)
        if active is not None:
            raise ApplicationError(
                f"you already have benchmark run {active.pk} {active.state}: one run at a time per user; "
                "wait for it to end or cancel it",
                extra={"active_run": active.pk},
            )
        run = BenchmarkRun.objects.create(
            kind=RunKind.MEASURED,
            title=asked.title,
            deployment=deployment,
            profile=profile,
            endpoint_url=endpoint_url.rstrip("/"),
            model_name=model_name,
            mix=mix_label,
            mix_definition=mix_definition,
            config=config,
            snapshot=snapshot,
            sla_p95_ttft_s=sla.p95_ttft_s,
            sla_p95_tpot_s=sla.p95_tpot_s,
            progress={"levels": len(plans), "level": None, "done": 0, "planned": None},
            created_by=user,
        )
        run_id = run.pk
        # Its own queue and worker: a long sweep never delays supervision or the usage flush on `control`.
        transaction.on_commit(lambda: _send_run(run_id))
    return run


def benchmark_run_cancel(*, run: BenchmarkRun) -> BenchmarkRun:
    """Ask a running job to stop (it keeps finished levels); a queued run, or a running one that no
    worker holds (its lease lapsed: nobody would read the request), is cancelled at once."""
    if run.finished:
        raise ApplicationError(f"run {run.pk} already finished ({run.state})", field="state")
    claimed = BenchmarkRun.objects.filter(pk=run.pk, state=RunState.QUEUED).update(
        state=RunState.CANCELLED,
        cancel_requested=True,
        finished_at=timezone.now(),
        state_reason="cancelled before it started",
    )
    if not claimed:
        BenchmarkRun.objects.filter(pk=run.pk).update(cancel_requested=True)
        benchmark_run_end_unheld(
            run=run,
            state=RunState.CANCELLED,
            reason="cancelled; no worker held the run (its lease had lapsed)",
        )
    run.refresh_from_db()
    return run
