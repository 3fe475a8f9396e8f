"""Writes for benchmark runs: create, execute (the Celery job's body), cancel, import, apply the SLA cap.

The job runs the async load generator (`inference.loadgen.loadgen.run_sweep`)
with `asyncio.run` in a worker thread, and keeps every ORM call on the task's
own thread: the generator's hooks only put events on a queue, which this thread
drains to save each level as it finishes, publish progress, renew the lease and
pass a cancel request back through a threading.Event.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import re
import threading
import time
from datetime import timedelta
from pathlib import Path

import httpx
from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from inference.errors import InputError
from inference.loadgen.loadgen import BenchConfig, LevelPlan, SweepResult, run_sweep
from inference.loadgen.sla import Sla, operating_point
from inference.loadgen.summary import little_law_from_table
from inference.loadgen.workloads import load_mix, mix_from_dict
from inference.planner import GB
from portal.celery import BENCHMARK_QUEUE
from portal.core.errors import ApplicationError
from portal.deployments.models import Deployment, DeploymentState
from portal.deployments.services import deployment_plan, deployment_set_concurrency_cap
from portal.teams.models import ApiKey
from portal.teams.services import api_key_new_secret, member_key_for

from .models import BenchmarkLevel, BenchmarkRun, RunKind, RunState

logger = logging.getLogger(__name__)

LEASE = timedelta(minutes=2)
PROGRESS_EVERY_S = 0.5
# Bounds for everyone, staff included: past these the load generator itself is the problem
# (one task per virtual user, a day-long level). Members get the tighter BENCHMARK_MEMBER_* settings.
MAX_LEVELS = 16
MAX_REQUESTS_PER_LEVEL = 100_000
MAX_CONCURRENCY = 4096
MAX_REQUEST_RATE = 10_000.0
MAX_LEVEL_S = 86_400.0
MAX_SEED = 2**31 - 1


def _input_error(error: InputError) -> ApplicationError:
    return ApplicationError.from_input_error(error)


def _level_plans(
    *,
    concurrencies: list[int] | None,
    request_rates: list[float] | None,
    requests_per_level: int | None,
    duration_s: float | None,
    warmup: int | None,
) -> list[LevelPlan]:
    if not concurrencies and not request_rates:
        raise ApplicationError("give at least one concurrency level (e.g. 16,32)", field="concurrencies")
    if len(concurrencies or []) + len(request_rates or []) > MAX_LEVELS:
        raise ApplicationError(f"at most {MAX_LEVELS} levels per run", field="concurrencies")
    if requests_per_level is not None and requests_per_level > MAX_REQUESTS_PER_LEVEL:
        raise ApplicationError(
            f"at most {MAX_REQUESTS_PER_LEVEL} requests per level", field="requests_per_level"
        )
    try:
        plans = [
            LevelPlan(concurrency=c, requests=requests_per_level, duration_s=duration_s, warmup=warmup)
            for c in concurrencies or []
        ]
        plans += [
            LevelPlan(request_rate=r, requests=requests_per_level, duration_s=duration_s, warmup=warmup)
            for r in request_rates or []
        ]
    except InputError as error:
        raise _input_error(error) from error
    return plans


def _check_bounds(
    *,
    user,
    deployment: Deployment | None,
    concurrencies: list[int],
    request_rates: list[float],
    requests_per_level: int | None,
    duration_s: float | None,
    level_timeout_s: float | None,
    seed: int,
) -> float | None:
    """Refuse what nobody may ask, then what a non-staff user may not; returns the level timeout.

    A member's levels always end: without a timeout of their own they get the longest a member's
    level may run. On a *shared* deployment with a gateway cap, a member's load stays within the
    cap: closed-loop levels up to it, and no open-loop level, whose in-flight count nothing bounds
    (docs/decisions.md, "Benchmarks: their own queue, and what a member may ask").
    """
    if any(not c <= MAX_CONCURRENCY for c in concurrencies):
        raise ApplicationError(f"concurrency levels are at most {MAX_CONCURRENCY}", field="concurrencies")
    if any(not r <= MAX_REQUEST_RATE for r in request_rates):
        raise ApplicationError(f"request rates are at most {MAX_REQUEST_RATE:g}/s", field="request_rates")
    if duration_s is not None and not duration_s <= MAX_LEVEL_S:
        raise ApplicationError(f"a level lasts at most {MAX_LEVEL_S:g} s", field="duration_s")
    if level_timeout_s is not None and not 0 < level_timeout_s <= MAX_LEVEL_S:
        raise ApplicationError(f"a level timeout is at most {MAX_LEVEL_S:g} s", field="level_timeout_s")
    if not 0 <= seed <= MAX_SEED:
        raise ApplicationError(f"the seed is between 0 and {MAX_SEED}", field="seed")
    if user.is_staff:
        return level_timeout_s
    limit = settings.BENCHMARK_MEMBER_MAX_LEVELS
    if len(concurrencies) + len(request_rates) > limit:
        raise ApplicationError(
            f"at most {limit} levels per run for non-staff users (BENCHMARK_MEMBER_MAX_LEVELS)",
            field="concurrencies",
        )
    limit = settings.BENCHMARK_MEMBER_MAX_CONCURRENCY
    if any(not c <= limit for c in concurrencies):
        raise ApplicationError(
            f"concurrency levels are at most {limit} for non-staff users (BENCHMARK_MEMBER_MAX_CONCURRENCY)",
            field="concurrencies",
        )
    limit = settings.BENCHMARK_MEMBER_MAX_REQUEST_RATE
    if any(not r <= limit for r in request_rates):
        raise ApplicationError(
            f"request rates are at most {limit:g}/s for non-staff users (BENCHMARK_MEMBER_MAX_REQUEST_RATE)",
            field="request_rates",
        )
    limit = settings.BENCHMARK_MEMBER_MAX_REQUESTS_PER_LEVEL
    if requests_per_level is not None and not requests_per_level <= limit:
        raise ApplicationError(
            f"at most {limit} requests per level for non-staff users "
            "(BENCHMARK_MEMBER_MAX_REQUESTS_PER_LEVEL)",
            field="requests_per_level",
        )
    limit = settings.BENCHMARK_MEMBER_MAX_LEVEL_S
    if duration_s is not None and not duration_s <= limit:
        raise ApplicationError(
            f"a level lasts at most {limit:g} s for non-staff users (BENCHMARK_MEMBER_MAX_LEVEL_S)",
            field="duration_s",
        )
    if level_timeout_s is not None and not level_timeout_s <= limit:
        raise ApplicationError(
            f"a level timeout is at most {limit:g} s for non-staff users (BENCHMARK_MEMBER_MAX_LEVEL_S)",
            field="level_timeout_s",
        )
    if deployment is not None and deployment.shared and deployment.concurrency_cap is not None:
        cap = deployment.concurrency_cap
        above = [c for c in concurrencies if c > cap]
        if above:
            raise ApplicationError(
                f"{deployment.name} is shared and its gateway cap is {cap}: a member's levels stay within it "
                f"({', '.join(map(str, above))} {'is' if len(above) == 1 else 'are'} above)",
                field="concurrencies",
            )
        if request_rates:
            raise ApplicationError(
                f"{deployment.name} is shared and capped at {cap} in flight: members run closed-loop "
                "levels there (an open-loop rate has no in-flight bound)",
                field="request_rates",
            )
    return level_timeout_s if level_timeout_s is not None else limit


def _active_run(user) -> BenchmarkRun | None:
    """The user's run that is queued, or running under a live lease (a dead worker's run does not count)."""
    live = Q(state=RunState.QUEUED) | Q(state=RunState.RUNNING, lease_expires_at__gte=timezone.now())
    return BenchmarkRun.objects.filter(live, created_by=user, kind=RunKind.MEASURED).order_by("pk").first()


def _plan_to_dict(plan: LevelPlan) -> dict:
    return {
        "concurrency": plan.concurrency,
        "request_rate": plan.request_rate,
        "requests": plan.requests,
        "duration_s": plan.duration_s,
        "warmup": plan.warmup,
    }


def deployment_tokenizer_path(deployment: Deployment) -> str:
    """The deployment's own tokenizer.json when this machine can read it (the control worker may not)."""
    directory = (deployment.model_version.path or "").strip()
    if directory and (Path(directory) / "tokenizer.json").is_file():
        return str(Path(directory) / "tokenizer.json")
    return ""


def deployment_snapshot(deployment: Deployment) -> dict:
    """What was measured, frozen when a run starts: profile, model version, node, GPUs, roofline inputs.

    An adopted endpoint (a server the portal did not start) has no profile, and maybe no node:
    what it lacks is left empty, never guessed.
    """
    profile = deployment.profile
    model = deployment.model_version
    node = deployment.node
    gpus = (
        [
            {"index": g.index, "name": g.name, "memory_mib": g.memory_mib, "bandwidth_gb_s": g.bandwidth_gb_s}
            for g in node.gpus.filter(index__in=deployment.gpu_indices or []).order_by("index")
        ]
        if node is not None
        else []
    )
    snapshot = {
        "deployment": deployment.name,
        "team": deployment.team.slug,
        "adopted": deployment.adopted,
        "profile": (
            {"name": profile.name, **dict(profile.settings_values().items())} if profile is not None else {}
        ),
        "engine": (profile.engine if profile is not None else "")
        or (node.engine if node is not None else "")
        or deployment.engine_used,
        "model_version": {
            "name": model.name,
            "source": model.source,
            "revision": model.revision,
            "weights_sha256": model.weights_sha256,
            "tokenizer_sha256": model.tokenizer_sha256,
            "param_count": model.param_count,
        },
        "node": (
            {"name": node.name, "engine": node.engine, "driver_version": node.driver_version}
            if node is not None
            else {}
        ),
        "gpus": gpus,
        "vllm_version": getattr(node, "vllm_version", "") or "",
    }
    try:
        plan = deployment_plan(deployment)
    except ApplicationError:
        plan = None
    if plan is not None and gpus:
        snapshot["roofline"] = {
            "weights_bytes_per_gpu": plan.weights_gb_per_gpu * GB,
            "kv_bytes_per_token_per_gpu": plan.kv_cache_bytes_per_token_per_gpu,
            "bandwidth_gb_s": min(g["bandwidth_gb_s"] for g in gpus),
        }
    return snapshot


def server_version(base_url: str, *, api_key: str = "") -> str:
    """vLLM serves its version at /version; other servers may not ("" then)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(f"{base_url.rstrip('/')}/version", timeout=3, headers=headers)
        if response.status_code == 200:
            return str(response.json().get("version") or "")
    except (httpx.HTTPError, ValueError, AttributeError):
        pass
    return ""


def benchmark_run_create(
    *,
    user,
    deployment: Deployment | None = None,
    endpoint_url: str = "",
    model_name: str = "",
    mix: str = "field-mix",
    concurrencies: list[int] | None = None,
    request_rates: list[float] | None = None,
    requests_per_level: int | None = None,
    duration_s: float | None = None,
    warmup: int | None = None,
    seed: int = 0,
    level_timeout_s: float | None = None,
    tokenizer: str = "",
    title: str = "",
) -> BenchmarkRun:
    """Queue a benchmark of a serving deployment (or, staff only, of any endpoint) on the benchmarks queue.

    `mix` is a preset, `fixed:<in>:<out>` or inline JSON, never a file: this is what HTTP reaches.
    A user has one run queued or running at a time.
    """
    try:
        mix_object = load_mix(mix)
    except InputError as error:
        raise _input_error(error) from error
    mix_definition = mix_object.to_dict()
    # What the history filters by: the preset or fixed spec, or the inline mix's name (marked).
    mix_label = f"json:{mix_object.name}" if mix.strip().startswith("{") else mix_object.name
    if requests_per_level is None and duration_s is None:
        requests_per_level = 64
    level_timeout_s = _check_bounds(
        user=user,
        deployment=deployment,
        concurrencies=list(concurrencies or []),
        request_rates=list(request_rates or []),
        requests_per_level=requests_per_level,
        duration_s=duration_s,
        level_timeout_s=level_timeout_s,
        seed=seed,
    )
    plans = _level_plans(
        concurrencies=concurrencies,
        request_rates=request_rates,
        requests_per_level=requests_per_level,
        duration_s=duration_s,
        warmup=warmup,
    )
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
        # What the run is bound to: it measures this deployment or nothing (`_engine_target`).
        "deployment_id": deployment.pk if deployment is not None else None,
        "levels": [_plan_to_dict(plan) for plan in plans],
        "seed": seed,
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
            title=title,
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
        from .tasks import run_benchmark

        run_id = run.pk
        # Its own queue and worker: a long sweep never delays supervision or the usage flush on `control`.
        transaction.on_commit(lambda: run_benchmark.apply_async(args=[run_id], queue=BENCHMARK_QUEUE))
    return run


def benchmark_run_cancel(*, run: BenchmarkRun) -> BenchmarkRun:
    """Ask a running job to stop (it keeps finished levels); a queued run is cancelled at once."""
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
    run.refresh_from_db()
    return run


def roofline_share(level: dict, snapshot: dict) -> dict | None:
    """Achieved share of the bandwidth roofline: bytes read per decode step ÷ (mean TPOT × GPU bandwidth).

    Bytes per step per GPU = its weight shard (planner) + the KV cache of the running batch
    (planner's bytes per token × concurrency × the mean context: prompt + half the output).
    """
    roofline = snapshot.get("roofline")
    tpot_ms = level.get("mean_tpot_ms")
    completed = level.get("completed") or 0
    if not roofline or not tpot_ms or not completed:
        return None
    batch = level.get("concurrency") or (level.get("little_law") or {}).get("concurrency_used") or 1
    mean_context = (level.get("total_input_tokens", 0) + level.get("total_output_tokens", 0) / 2) / completed
    step_bytes = (
        roofline["weights_bytes_per_gpu"] + roofline["kv_bytes_per_token_per_gpu"] * batch * mean_context
    )
    share = step_bytes / (tpot_ms / 1000 * roofline["bandwidth_gb_s"] * GB)
    return {
        "bytes_per_step_per_gpu": step_bytes,
        "bandwidth_gb_s": roofline["bandwidth_gb_s"],
        "share": share,
    }


class _QueueHooks:
    """Hooks for run_sweep: called on the event loop, they only queue events (no ORM there)."""

    def __init__(self, events: queue.Queue, cancel: threading.Event, offset: int) -> None:
        self.events = events
        self.cancel = cancel
        self.offset = offset

    def level_started(self, index: int, plan: LevelPlan) -> None:
        self.events.put(("start", index + self.offset, None))

    def progress(self, index: int, done: int, planned: int | None) -> None:
        self.events.put(("progress", index + self.offset, (done, planned)))

    def level_finished(self, index: int, level: dict) -> None:
        self.events.put(("level", index + self.offset, level))

    def cancelled(self) -> bool:
        return self.cancel.is_set()


def _claim(run_id: int) -> bool:
    """Queued → running; or take over a running run whose lease expired (its worker died)."""
    now = timezone.now()
    return bool(
        BenchmarkRun.objects.filter(pk=run_id)
        .filter(Q(state=RunState.QUEUED) | Q(state=RunState.RUNNING, lease_expires_at__lt=now))
        .update(state=RunState.RUNNING, started_at=now, lease_expires_at=now + LEASE)
    )


def _save_level(run: BenchmarkRun, index: int, level: dict) -> None:
    samples = level.pop("samples", {}) or {}
    share = roofline_share(level, run.snapshot)
    level["roofline"] = share
    BenchmarkLevel.objects.update_or_create(
        run=run,
        index=index,
        defaults={
            "concurrency": level.get("concurrency"),
            "request_rate": level.get("request_rate"),
            "results": level,
            "samples": samples,
        },
    )


def benchmark_run_execute(*, run_id: int) -> None:
    """The job: claim the run, measure the levels not yet saved, save each as it ends, pick the SLA point."""
    if not _claim(run_id):
        return  # a duplicate delivery, or a run someone else holds or that already ended
    run = BenchmarkRun.objects.get(pk=run_id)
    try:
        _execute(run)
    except Exception as error:
        # Never leave a run "running" behind a crash: record why, keep the saved levels.
        logger.exception("benchmark run %s failed", run_id)
        run.refresh_from_db()
        if not run.finished:
            state = RunState.PARTIAL if run.levels.exists() else RunState.FAILED
            _finish(run, state, f"the job crashed: {type(error).__name__}: {error}")
        raise


class _Refused(Exception):
    """The run cannot start: what it was bound to is gone or not serving (the message says which)."""


def _bound_deployment_id(run: BenchmarkRun) -> int | None:
    """The deployment a run was created for, even after the deployment's row is gone (the foreign
    key is then NULL): its id is kept in the config; runs older than that have a snapshot."""
    bound = run.config.get("deployment_id")
    if bound is None and run.snapshot:
        return run.deployment_id or -1  # created for a deployment whose id was not kept
    return bound


def _engine_target(run: BenchmarkRun) -> tuple[Deployment | None, str]:
    """(the deployment measured, the server's own key), read when the run starts, never stored.

    A run created for a deployment measures that deployment, where it serves now, or refuses:
    never whatever server has since taken its old URL (another team's, perhaps). Only a staff
    run by URL looks up the key of the deployment serving at that URL.
    """
    bound = _bound_deployment_id(run)
    if bound is not None:
        deployment = Deployment.objects.select_related("team", "model_version").filter(pk=bound).first()
        name = run.snapshot.get("deployment") or f"deployment {bound}"
        if deployment is None:
            raise _Refused(f"{name} was deleted before the run started: nothing to measure")
        if deployment.state != DeploymentState.SERVING or not deployment.endpoint_url:
            raise _Refused(f"{name} is {deployment.state}, not serving: nothing to measure")
        return deployment, deployment.engine_api_key
    root = run.endpoint_url.rstrip("/").removesuffix("/v1")  # given as OpenAI clients are, or not
    found = Deployment.objects.filter(endpoint_url=root).exclude(endpoint_url="")
    return None, found.values_list("engine_api_key", flat=True).first() or ""


def _execute(run: BenchmarkRun) -> None:
    if run.cancel_requested:
        _finish(run, RunState.CANCELLED, "cancelled before it started")
        return
    saved = set(run.levels.values_list("index", flat=True))
    try:
        plans = [LevelPlan(**plan) for plan in run.config["levels"]]
        # The definition frozen at creation, not the spec again: no file is read here.
        mix = mix_from_dict(run.mix_definition, default_name=run.mix)
    except InputError as error:
        _finish(run, RunState.FAILED, str(error))
        return
    first = next((i for i in range(len(plans)) if i not in saved), None)
    if first is None:
        _finish(run, RunState.DONE, "")
        return
    try:
        deployment, api_key = _engine_target(run)
    except _Refused as refusal:
        _finish(run, RunState.PARTIAL if saved else RunState.FAILED, str(refusal))
        return
    endpoint_url = deployment.endpoint_url if deployment is not None else run.endpoint_url
    if not run.snapshot.get("vllm_version"):
        version = server_version(endpoint_url, api_key=api_key)
        if version:
            run.snapshot["vllm_version"] = version
            BenchmarkRun.objects.filter(pk=run.pk).update(snapshot=run.snapshot)
    sla = Sla(run.sla_p95_ttft_s, run.sla_p95_tpot_s)
    config = BenchConfig(
        base_url=endpoint_url,
        model=run.model_name,
        mix=mix,
        levels=plans[first:],
        seed=run.config.get("seed", 0),
        tokenizer=run.config.get("tokenizer") or None,
        level_timeout_s=run.config.get("level_timeout_s"),
        slo={"ttft": sla.p95_ttft_s * 1000, "tpot": sla.p95_tpot_s * 1000},
        api_key=api_key or None,
    )
    if deployment is None or not _through_gateway(run):
        _sweep(run, config, first)  # staff: straight to the engine
        return
    try:
        key, token = _member_gateway_key(run, deployment)
    except _Refused as refusal:
        _finish(run, RunState.PARTIAL if saved else RunState.FAILED, str(refusal))
        return
    # The team's traffic: through the gateway as the member's benchmark key, pinned to this
    # deployment; /metrics is still read from the engine (nothing is spent there).
    config.base_url, config.api_key = settings.BENCHMARK_GATEWAY_URL, token
    config.metrics_base_url, config.metrics_api_key = endpoint_url, api_key or None
    note = (
        f"Sent through the gateway as {key.name} of team {deployment.team.slug}: the team's quotas, "
        "max_tokens clamp and priority class applied, and its usage counts these requests."
    )
    BenchmarkRun.objects.filter(pk=run.pk).update(notes=note)
    try:
        _sweep(run, config, first)
    finally:
        # The run's secret dies with it: a new one that nobody holds.
        api_key_new_secret(
            api_key=key, allowed_models=key.allowed_models, pinned_deployment_id=deployment.pk
        )


def _through_gateway(run: BenchmarkRun) -> bool:
    """A member's run is that team's traffic; staff runs (and imports) may go to the engine."""
    return run.created_by is None or not run.created_by.is_staff


def _member_gateway_key(run: BenchmarkRun, deployment: Deployment) -> tuple[ApiKey, str]:
    """The run's creator's benchmark key of the deployment's team, made on first use (as the
    playground's key), with a fresh secret pinned to the deployment and its model."""
    user, team = run.created_by, deployment.team
    if user is None:
        raise _Refused("the account that queued this run was deleted: no one's quota to run it on")
    if not team.members.filter(pk=user.pk).exists():
        raise _Refused(
            f"{user.get_username()} is no longer a member of {team.name}: the run would spend its quota"
        )
    key = member_key_for(team=team, user=user, purpose="benchmark")
    token = api_key_new_secret(
        api_key=key, allowed_models=[deployment.model_version.name], pinned_deployment_id=deployment.pk
    )
    return key, token


def _sweep(run: BenchmarkRun, config: BenchConfig, first: int) -> None:
    """Measure the levels from `first` on a worker thread; this thread saves them and finishes the run."""
    events: queue.Queue = queue.Queue()
    cancel = threading.Event()
    outcome: dict = {}

    def work() -> None:
        try:
            outcome["result"] = asyncio.run(run_sweep(config, _QueueHooks(events, cancel, first)))
        except InputError as error:
            outcome["error"] = str(error)
        except Exception as error:  # the thread must always report back; the job records it
            logger.exception("benchmark run %s crashed", run.pk)
            outcome["error"] = f"the load generator crashed: {type(error).__name__}: {error}"
        finally:
            events.put(("end", None, None))

    thread = threading.Thread(target=work, name=f"benchmark-{run.pk}", daemon=True)
    thread.start()
    progress = dict(run.progress)
    last_write = 0.0
    ended = False
    try:
        while True:
            try:
                kind, index, payload = events.get(timeout=PROGRESS_EVERY_S)
            except queue.Empty:
                kind, index, payload = "tick", None, None
            if kind == "start":
                progress.update(level=index, done=0, planned=None)
            elif kind == "progress":
                progress.update(level=index, done=payload[0], planned=payload[1])
            elif kind == "level":
                _save_level(run, index, payload)
            now = time.monotonic()
            if kind in ("level", "end", "start") or now - last_write >= PROGRESS_EVERY_S:
                last_write = now
                # One write publishes progress, renews the lease and reads a cancel request.
                BenchmarkRun.objects.filter(pk=run.pk).update(
                    progress=progress, lease_expires_at=timezone.now() + LEASE
                )
                if BenchmarkRun.objects.filter(pk=run.pk, cancel_requested=True).exists():
                    cancel.set()
            if kind == "end":
                ended = True
                break
    finally:
        # Also on a crash of this thread: stop the load generator before giving up.
        if not ended:
            cancel.set()
        thread.join(timeout=120)

    result: SweepResult | None = outcome.get("result")
    if result is not None:
        BenchmarkRun.objects.filter(pk=run.pk).update(
            prompt_source=result.prompt_source
            + (f" (server adds {result.prompt_token_offset} token(s))" if result.prompt_token_offset else ""),
            prompt_tokens_exact=result.prompt_tokens_exact,
        )
    run.refresh_from_db()
    if "error" in outcome:
        state = RunState.PARTIAL if run.levels.exists() else RunState.FAILED
        _finish(run, state, outcome["error"])
    elif result.cancelled or cancel.is_set():
        _finish(run, RunState.CANCELLED, result.error or "cancelled")
    elif result.error:
        _finish(run, RunState.PARTIAL, result.error)
    else:
        _finish(run, RunState.DONE, "")


def benchmark_run_pick_sla(run: BenchmarkRun) -> tuple[int | None, str]:
    levels = [level.results for level in run.levels.all()]
    return operating_point(levels, Sla(run.sla_p95_ttft_s, run.sla_p95_tpot_s))


def _finish(run: BenchmarkRun, state: str, reason: str) -> None:
    concurrency, why = benchmark_run_pick_sla(run)
    BenchmarkRun.objects.filter(pk=run.pk).update(
        state=state,
        state_reason=reason,
        finished_at=timezone.now(),
        lease_expires_at=None,
        sla_concurrency=concurrency,
        sla_reason=why,
    )


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


# docs/v100-field-guide.md#reference-run: 7B/TP8 on 8×V100-32G with the 40/30/20/10 mix (one run).
FIELD_GUIDE_7B_TABLE = """\
| concurrency | output tok/s | mean TTFT s | P95 TTFT s | mean TPOT s | P95 TPOT s |
|---|---|---|---|---|---|
| 16 | 1380 | 0.45 | 0.82 | 0.042 | 0.065 |
| 32 | 2350 | 0.63 | 1.35 | 0.058 | 0.088 |
| 64 | 3560 | 1.05 | 2.10 | 0.076 | 0.120 |
| 128 | 4820 | 1.85 | 3.20 | 0.104 | 0.175 |
| 256 | 5630 | 3.40 | 6.50 | 0.155 | 0.310 |
"""

# Header words → (level key, multiplier to vLLM's unit). Seconds become ms.
_COLUMNS = (
    (("concurrency",), "concurrency", None),
    (("output", "tok"), "output_throughput", 1.0),
    (("req",), "request_throughput", 1.0),
    (("mean", "ttft"), "mean_ttft_ms", None),
    (("p95", "ttft"), "p95_ttft_ms", None),
    (("mean", "tpot"), "mean_tpot_ms", None),
    (("p95", "tpot"), "p95_tpot_ms", None),
    (("mean", "e2el"), "mean_e2el_ms", None),
    (("mean", "output", "tokens"), "mean_output_tokens", 1.0),
)


def parse_table(text: str) -> list[dict]:
    """A Markdown/CSV/TSV table of per-level figures → level dicts under vLLM's key names."""
    lines = [line.strip().strip("|") for line in text.strip().splitlines() if line.strip()]
    rows = [[cell.strip() for cell in re.split(r"\s*[|,\t]\s*", line)] for line in lines]
    rows = [row for row in rows if not all(set(cell) <= set("-: ") for cell in row)]
    if len(rows) < 2:
        raise ApplicationError("paste a header row and at least one level", field="table")
    header = [cell.lower() for cell in rows[0]]
    mapping: list[tuple[str, float] | None] = []
    for cell in header:
        found = None
        for words, key, factor in sorted(_COLUMNS, key=lambda c: -len(c[0])):
            if all(word in cell for word in words):
                if factor is None:
                    factor = 1000.0 if re.search(r"\bs\b|\(s\)|seconds", cell) else 1.0
                found = (key, factor)
                break
        mapping.append(found)
    if not any(m and m[0] == "concurrency" for m in mapping):
        raise ApplicationError("the header needs a concurrency column", field="table")
    levels = []
    for number, row in enumerate(rows[1:], start=2):
        if len(row) != len(header):
            raise ApplicationError(
                f"row {number} has {len(row)} cells, the header {len(header)}", field="table"
            )
        level: dict = {"failed": None}
        for cell, target in zip(row, mapping, strict=True):
            if target is None or not cell:
                continue
            try:
                value = float(cell.replace("≈", "").replace("~", ""))
            except ValueError as error:
                raise ApplicationError(f"row {number}: {cell!r} is not a number", field="table") from error
            key, factor = target
            level[key] = int(value) if key == "concurrency" else value * factor
        levels.append(level)
    return levels


def benchmark_import_table(
    *, user, title: str, text: str, deployment: Deployment | None = None, profile=None, mix: str = "imported"
) -> BenchmarkRun:
    """Staff: store an external table as a run, each level checked against Little's law."""
    if not user.is_staff:
        raise ApplicationError("only staff may import tables", field="table")
    levels = parse_table(text)
    with transaction.atomic():
        run = BenchmarkRun.objects.create(
            kind=RunKind.IMPORTED,
            title=title or "imported table",
            deployment=deployment,
            profile=profile or (deployment.profile if deployment else None),
            mix=mix,
            state=RunState.DONE,
            config={"source_table": text},
            created_by=user,
            started_at=timezone.now(),
            finished_at=timezone.now(),
            notes="Imported: only the columns of the table are known.",
        )
        for index, level in enumerate(levels):
            level["little_law"] = little_law_from_table(level)
            BenchmarkLevel.objects.create(
                run=run, index=index, concurrency=level.get("concurrency"), results=level
            )
        concurrency, why = operating_point(levels, Sla(run.sla_p95_ttft_s, run.sla_p95_tpot_s))
        run.sla_concurrency, run.sla_reason = concurrency, why
        run.save(update_fields=["sla_concurrency", "sla_reason"])
    return run
