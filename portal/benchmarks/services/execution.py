"""The benchmark job's body (`benchmark_run_execute`, run by the `benchmarks.run` task): claim the
run, measure the levels not yet saved, save each as it ends, pick the SLA point.

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
import threading
import time

from django.conf import settings
from django.db.models import Q
from django.utils import timezone

from inference.errors import InputError
from inference.loadgen.loadgen import BenchConfig, LevelPlan, SweepResult, run_sweep
from inference.loadgen.sla import Sla
from inference.loadgen.workloads import mix_from_dict
from portal.core.jobs import Lease, LostLease, claim, lease_break, lease_free, worker_name
from portal.deployments.models import Deployment, DeploymentState
from portal.registry.selectors import model_version_gateway_name
from portal.teams.models import ApiKey
from portal.teams.services import api_key_new_secret, member_key_for

from ..models import BenchmarkLevel, BenchmarkRun, RunState
from .sla import benchmark_run_pick_sla
from .snapshot import roofline_share, server_version

logger = logging.getLogger(__name__)

PROGRESS_EVERY_S = 0.5


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


def _claim(run_id: int, worker: str) -> Lease | None:
    """Queued → running; or take over a running run whose lease lapsed (its worker died or stalled)."""
    return claim(
        BenchmarkRun,
        run_id,
        worker=worker,
        ttl_s=settings.BENCHMARK_LEASE_S,
        claimable=Q(state__in=[RunState.QUEUED, RunState.RUNNING]),
        live=Q(state=RunState.RUNNING),
        state=RunState.RUNNING,
        started_at=timezone.now(),
    )


def _save_level(lease: Lease, run: BenchmarkRun, index: int, level: dict) -> None:
    samples = level.pop("samples", {}) or {}
    share = roofline_share(level, run.snapshot)
    level["roofline"] = share
    with lease.fenced():  # a worker that lost the run saves nothing over the new holder's levels
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


def benchmark_run_execute(*, run_id: int, worker: str = "") -> str:
    """The job: claim the run, measure the levels not yet saved, save each as it ends, pick the SLA
    point. Returns what became of it: "busy" (a duplicate delivery, or a run someone else holds or
    that already ended), "lease lost" (stalled past the lease: another worker took the run over,
    and none of this worker's later writes were kept) or the run's final state."""
    lease = _claim(run_id, worker or worker_name())
    if lease is None:
        return "busy"
    run = BenchmarkRun.objects.get(pk=run_id)
    try:
        _execute(lease, run)
    except LostLease:
        logger.warning("benchmark run %s: lease %s lost; the new holder's writes stand", run_id, lease.token)
        return "lease lost"
    except Exception as error:
        # Never leave a run "running" behind a crash: record why, keep the saved levels.
        logger.exception("benchmark run %s failed", run_id)
        run.refresh_from_db()
        if not run.finished:
            state = RunState.PARTIAL if run.levels.exists() else RunState.FAILED
            _finish(lease, run, state, f"the job crashed: {type(error).__name__}: {error}")
        raise
    return BenchmarkRun.objects.values_list("state", flat=True).get(pk=run_id)


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


def _execute(lease: Lease, run: BenchmarkRun) -> None:
    if run.cancel_requested:
        _finish(lease, run, RunState.CANCELLED, "cancelled before it started")
        return
    saved = set(run.levels.values_list("index", flat=True))
    try:
        plans = [LevelPlan(**plan) for plan in run.config["levels"]]
        # The definition frozen at creation, not the spec again: no file is read here.
        mix = mix_from_dict(run.mix_definition, default_name=run.mix)
    except InputError as error:
        _finish(lease, run, RunState.FAILED, str(error))
        return
    first = next((i for i in range(len(plans)) if i not in saved), None)
    if first is None:
        _finish(lease, run, RunState.DONE, "")
        return
    try:
        deployment, api_key = _engine_target(run)
    except _Refused as refusal:
        _finish(lease, run, RunState.PARTIAL if saved else RunState.FAILED, str(refusal))
        return
    endpoint_url = deployment.endpoint_url if deployment is not None else run.endpoint_url
    if not run.snapshot.get("vllm_version"):
        version = server_version(endpoint_url, api_key=api_key)
        if version:
            run.snapshot["vllm_version"] = version
            lease.write(snapshot=run.snapshot)
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
        _sweep(lease, run, config, first)  # staff: straight to the engine
        return
    try:
        model = _gateway_model_name(deployment)
        key, token = _member_gateway_key(run, deployment, model)
    except _Refused as refusal:
        _finish(lease, run, RunState.PARTIAL if saved else RunState.FAILED, str(refusal))
        return
    # The team's traffic: through the gateway as the member's benchmark key, pinned to this
    # deployment; /metrics is still read from the engine (nothing is spent there).
    config.base_url, config.api_key, config.model = settings.BENCHMARK_GATEWAY_URL, token, model
    config.metrics_base_url, config.metrics_api_key = endpoint_url, api_key or None
    note = (
        f"Sent through the gateway as {key.name} of team {deployment.team.slug}: the team's quotas, "
        "max_tokens clamp and priority class applied, and its usage counts these requests."
    )
    lease.write(notes=note)
    try:
        _sweep(lease, run, config, first)
    finally:
        # The run's secret dies with it: a new one that nobody holds.
        api_key_new_secret(api_key=key, allowed_models=key.allowed_models, pinned_deployment_id=deployment.pk)


def _through_gateway(run: BenchmarkRun) -> bool:
    """A member's run is that team's traffic; staff runs (and imports) may go to the engine."""
    return run.created_by is None or not run.created_by.is_staff


def _gateway_model_name(deployment: Deployment) -> str:
    """The name the gateway routes to the deployment's version: its own, or a served name over it
    when clients may not call the version by name (the pinned key still reaches only this replica)."""
    name = model_version_gateway_name(deployment.model_version)
    if name is None:
        raise _Refused(
            f"{deployment.model_version.name} is callable only through a served name, and no served "
            "name gives it a share: the gateway has no name to route the run by"
        )
    return name


def _member_gateway_key(run: BenchmarkRun, deployment: Deployment, model: str) -> tuple[ApiKey, str]:
    """The run's creator's benchmark key of the deployment's team, made on first use (as the
    playground's key), with a fresh secret pinned to the deployment and allowed `model` only."""
    user, team = run.created_by, deployment.team
    if user is None:
        raise _Refused("the account that queued this run was deleted: no one's quota to run it on")
    if not team.members.filter(pk=user.pk).exists():
        raise _Refused(
            f"{user.get_username()} is no longer a member of {team.name}: the run would spend its quota"
        )
    key = member_key_for(team=team, user=user, purpose="benchmark")
    token = api_key_new_secret(api_key=key, allowed_models=[model], pinned_deployment_id=deployment.pk)
    return key, token


def _sweep(lease: Lease, run: BenchmarkRun, config: BenchConfig, first: int) -> None:
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
                _save_level(lease, run, index, payload)
            now = time.monotonic()
            if kind in ("level", "end", "start") or now - last_write >= PROGRESS_EVERY_S:
                last_write = now
                # One fenced write publishes progress and renews the lease; a run ended or taken
                # over without this job raises LostLease, and the `finally` stops the measuring.
                lease.write(progress=progress)
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
        lease.write(
            prompt_source=result.prompt_source
            + (f" (server adds {result.prompt_token_offset} token(s))" if result.prompt_token_offset else ""),
            prompt_tokens_exact=result.prompt_tokens_exact,
        )
    run.refresh_from_db()
    if "error" in outcome:
        state = RunState.PARTIAL if run.levels.exists() else RunState.FAILED
        _finish(lease, run, state, outcome["error"])
    elif result is None:  # the sweep's thread neither returned nor raised (still running past its join)
        raise RuntimeError(f"benchmark run {run.pk}: the load generator did not finish")
    elif result.cancelled or cancel.is_set():
        _finish(lease, run, RunState.CANCELLED, result.error or "cancelled")
    elif result.error:
        _finish(lease, run, RunState.PARTIAL, result.error)
    else:
        _finish(lease, run, RunState.DONE, "")


def _finish(lease: Lease, run: BenchmarkRun, state: str, reason: str) -> bool:
    """End the running run; False when it was ended or taken over meanwhile without this job (by
    the sweep, a cancel while its lease had lapsed, another worker): the first to end it decides."""
    concurrency, why = benchmark_run_pick_sla(run)
    try:
        lease.finish(
            state=state,
            state_reason=reason,
            finished_at=timezone.now(),
            sla_concurrency=concurrency,
            sla_reason=why,
        )
    except LostLease:
        return False
    return True


def _unheld(now) -> Q:
    """Running, and no worker holds it: the lease lapsed (or was never written)."""
    return Q(state=RunState.RUNNING) & lease_free(now)


def benchmark_run_end_unheld(*, run: BenchmarkRun, state: str, reason: str) -> bool:
    """End `run` as `state` if it is running and no worker holds its lease; False otherwise (a
    worker renewed it meanwhile: the job keeps its run). One claim, checked again in the update."""
    now = timezone.now()
    # Breaking the lease moves the token on: a worker that only stalled is fenced out when it wakes.
    if not lease_break(
        BenchmarkRun.objects.filter(_unheld(now), pk=run.pk),
        state=state,
        state_reason=reason,
        finished_at=now,
    ):
        return False
    run.refresh_from_db()
    concurrency, why = benchmark_run_pick_sla(run)
    BenchmarkRun.objects.filter(pk=run.pk).update(sla_concurrency=concurrency, sla_reason=why)
    return True


def benchmark_runs_expire() -> list[int]:
    """Beat: end every run whose lease lapsed (its worker was killed, or lost the database) as
    failed, or partial when levels were saved (kept); cancelled when a cancel was asked. Returns
    their ids.

    The redelivered job cannot do this: it arrives while the dead worker's lease still looks live,
    drops itself as a duplicate, and nothing else would ever end the run (docs/concurrency.md).
    """
    ended = []
    for run in BenchmarkRun.objects.filter(_unheld(timezone.now())).order_by("pk"):
        if run.cancel_requested:
            state, reason = RunState.CANCELLED, "cancelled; no worker held the run"
        else:
            state = RunState.PARTIAL if run.levels.exists() else RunState.FAILED
            reason = (
                "its worker stopped renewing the run's lease (killed, or cut off from the database); "
                "levels saved before are kept"
            )
        lapsed_at = run.lease_expires_at
        if benchmark_run_end_unheld(run=run, state=state, reason=reason):
            logger.warning("benchmark run %s ended %s: its lease lapsed at %s", run.pk, state, lapsed_at)
            ended.append(run.pk)
    return ended
