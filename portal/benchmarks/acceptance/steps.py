"""The steps of a node acceptance (`run.py` runs them in order), each returning the message its
progress entry shows or raising AcceptanceStepFailed with why it could not do its work."""

from __future__ import annotations

import json
import time
from pathlib import Path

from django.conf import settings
from django.utils import timezone

from inference.engines import VOLTA_ADVICE, engine_line
from inference.errors import InputError
from inference.gpu_health import read_sample
from inference.loadgen.loadgen import BenchConfig, LevelPlan, run_blocking, run_sweep
from inference.loadgen.sla import Sla, operating_point
from inference.loadgen.workloads import load_mix
from inference.nvidia_smi import discover_local
from inference.tiny_model import llama_config, resolve_shape, write_model_atomically
from portal.core.errors import ApplicationError, clean_or_raise
from portal.deployments import predict  # by module: its sweeps are looked up when called (tests stand in)
from portal.deployments.agent.environment import kernel_problem, problem_advice
from portal.deployments.agent.lease import agent_owner
from portal.deployments.agent.start import deployment_start
from portal.deployments.agent.stop import deployment_stop
from portal.deployments.launch import knob_values, launch_settings
from portal.deployments.models import Deployment, DeploymentProfile, DeploymentState, DesiredState
from portal.deployments.services import deployment_create
from portal.inventory.models import ACCEPTANCE_TEAM_SLUG, GpuHealth, Node, NodeAcceptance
from portal.inventory.selectors import node_latest_calibration
from portal.inventory.services import node_apply_discovery, node_probe_software, node_record_gpu_health
from portal.registry.models import ModelVersion
from portal.registry.services import model_version_create, model_version_hash_files
from portal.teams.models import Team

from .feature_probe import ProbeTarget, probe_features
from .judging import compare
from .options import (
    LAUNCH_FLAGS,
    SEED,
    model_name_for,
    probed_features,
    reference_deployment_name,
    reference_profile_values,
    requests_per_level_default,
)
from .record import AcceptanceContext, AcceptanceStepFailed, RunningAcceptance

REQUEST_TIMEOUT_S = 600.0  # one request of a 7B on a slow node: what `manage.py bench` allows


def _simulated(node: Node) -> bool:
    return node.engine == "sim"


def discover_gpus(node: Node) -> str:
    recorded = node.gpus.count()
    if _simulated(node):
        return f"simulated node: its {recorded} GPUs are as entered"
    try:
        readings, topology = discover_local()
    except InputError as error:
        raise AcceptanceStepFailed(f"discovery failed: {error}") from error
    if not readings:
        if recorded:
            raise AcceptanceStepFailed(
                f"nvidia-smi found no GPU, but {recorded} are recorded: is the driver loaded?"
            )
        return "no NVIDIA GPU: a CPU node"
    try:
        gpus = node_apply_discovery(node=node, readings=readings, topology=topology)
    except ApplicationError as error:
        raise AcceptanceStepFailed(error.message) from error
    names = sorted({g.name for g in gpus})
    return f"{len(gpus)} × {', '.join(names)}, driver {readings[0].driver_version or '?'}"


def read_health(run: RunningAcceptance, node: Node, moment: str) -> str:
    """Sample the GPUs' health, keep the readings on the record (`gpu_health[moment]`), and fail the
    node unless every GPU is healthy (docs/decisions.md, "GPU health")."""
    if not node.gpus.exists():
        return "no GPU: nothing to read"
    sample = read_sample(timeout_s=settings.GPU_HEALTH_COMMAND_TIMEOUT_S)
    if sample.unavailable:
        if _simulated(node):
            return "simulated node without nvidia-smi: nothing to read"
        raise AcceptanceStepFailed("nvidia-smi is not installed: the GPUs' health cannot be read")
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
        raise AcceptanceStepFailed(f"not every GPU is healthy: {reasons}")
    temperatures = [r.temperature_c for r in sample.gpus if r.temperature_c is not None]
    hottest = f", hottest {max(temperatures):.0f} °C" if temperatures else ""
    return f"{len(gpus)} GPUs healthy{hottest}"


def probe_software(run: RunningAcceptance, node: Node) -> str:
    if _simulated(node):
        facts = "simulated node: no vLLM environment to probe"
    else:
        try:
            node_probe_software(node=node)
        except ApplicationError as error:
            raise AcceptanceStepFailed(error.message) from error
        node.refresh_from_db()
        facts = f"vLLM {node.vllm_version}, torch {node.torch_version}"
        if node.torch_cuda_version:
            facts += f", CUDA {node.torch_cuda_version}"
    gpus = list(node.gpus.filter(index__in=run.acceptance.gpu_indices))
    if gpus and not _simulated(node):
        # The engine's own kernels are checked here, the first step that knows them, so a node
        # whose vLLM cannot run on its GPUs fails in seconds naming what to install, not later
        # at the reference launch (docs/engines.md).
        if not node.torch_cuda_version:
            raise AcceptanceStepFailed(
                f"{facts} is a CPU build, but the node has GPUs: install a CUDA build "
                f"(on a V100: {VOLTA_ADVICE})"
            )
        problem = kernel_problem(node, [g.compute_capability for g in gpus])
        if problem:
            raise AcceptanceStepFailed(f"{problem} for {gpus[0].name}: {problem_advice(node, gpus)}")
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


def write_model(run: RunningAcceptance, context: AcceptanceContext) -> str:
    acceptance = run.acceptance
    if acceptance.node.engine == "sim":
        return _register_config_only(run, context)
    name = model_name_for(acceptance)
    directory = Path(settings.ACCEPTANCE_MODEL_DIR) / name
    _, shape = resolve_shape(acceptance.shape, layers=acceptance.layers)
    written = "already on this node"
    if not (directory / "config.json").is_file():
        began = time.monotonic()
        try:
            write_model_atomically(directory, shape=shape, seed=SEED, dtype=acceptance.dtype)
        except OSError as error:
            raise AcceptanceStepFailed(f"cannot write {directory}: {error}") from error
        written = f"written in {time.monotonic() - began:.1f} s"
    version = ModelVersion.objects.filter(name=name).first()
    if version is None:
        config = json.loads((directory / "config.json").read_text())
        try:
            with run.lease.fenced():  # a runner that lost the acceptance registers nothing
                version = model_version_create(
                    name=name,
                    config=config,
                    path=str(directory),
                    source=f"node acceptance ({acceptance.shape})",
                )
                model_version_hash_files(model_version=version)
        except ApplicationError as error:
            raise AcceptanceStepFailed(f"cannot register {name}: {error.message}") from error
    elif version.path != str(directory):
        raise AcceptanceStepFailed(
            f"{name} is registered at {version.path}, not at {directory}: set ACCEPTANCE_MODEL_DIR"
        )
    run.write(model_name=name)
    context.version = version
    size = sum(f.stat().st_size for f in directory.iterdir() if f.is_file())
    return (
        f"{name}: {version.num_layers} layers, hidden {version.hidden_size}, vocab {version.vocab_size}, "
        f"{size / 1e9:.2f} GB {acceptance.dtype}, {written}"
    )


def _register_config_only(run: RunningAcceptance, context: AcceptanceContext) -> str:
    """A simulated node runs the simulator, which reads only the architecture (the stored config,
    portal/deployments/agent/environment.py): no weights are written (issue 38: 13 GB of random
    weights for a 7B shape). Its own name, so a real node's acceptance of the shape, whose version
    has files and hashes, is never taken for this one."""
    acceptance = run.acceptance
    name = f"{model_name_for(acceptance)}-sim"
    _, shape = resolve_shape(acceptance.shape, layers=acceptance.layers)
    version = ModelVersion.objects.filter(name=name).first()
    if version is None:
        config = llama_config(shape, bos_token_id=1, eos_token_id=2, dtype=acceptance.dtype)
        try:
            with run.lease.fenced():  # a runner that lost the acceptance registers nothing
                version = model_version_create(
                    name=name, config=config, source=f"node acceptance ({acceptance.shape}, simulated node)"
                )
        except ApplicationError as error:
            raise AcceptanceStepFailed(f"cannot register {name}: {error.message}") from error
    run.write(model_name=name)
    context.version = version
    return (
        f"{name}: {version.num_layers} layers, hidden {version.hidden_size}: no weights written "
        "(a simulated node reads only the config)"
    )


def _profile_values(acceptance: NodeAcceptance, version: ModelVersion) -> dict:
    """The reference profile (options.reference_profile_values). The dtype stays the acceptance's."""
    return reference_profile_values(
        cpu=not acceptance.gpu_indices,
        positions=version.max_position_embeddings,
        most_users=max(acceptance.concurrency),
        enforce_eager=acceptance.enforce_eager,
        flags=acceptance.profile_flags,
    )


def _reference_team() -> Team:
    """The portal's own team for reference deployments, made on first use; never a team of users
    that happens to have the slug (one made before the slug was reserved)."""
    team, _ = Team.objects.get_or_create(
        slug=ACCEPTANCE_TEAM_SLUG, defaults={"name": "Node acceptance", "gpu_quota": 1024, "system": True}
    )
    if not team.system:
        raise AcceptanceStepFailed(
            f"team “{team.name}” has the slug “{ACCEPTANCE_TEAM_SLUG}”, reserved for the reference "
            "deployments of node acceptance: give it another slug in the admin"
        )
    return team


def start_reference(run: RunningAcceptance, context: AcceptanceContext) -> str:
    acceptance = run.acceptance
    node, version = acceptance.node, context.reference_version
    team = _reference_team()
    name = reference_deployment_name(acceptance)
    gpus = list(node.gpus.filter(index__in=acceptance.gpu_indices))
    values = _profile_values(acceptance, version)
    profile = DeploymentProfile(
        name=name,
        description=f"node acceptance {acceptance.pk} of {node.name}"
        + (f" with the flags of {acceptance.profile_name}" if acceptance.profile_name else ""),
        model_version=version,
        target_gpu=gpus[0].catalog_key if gpus else "",
        **values,
    )
    if acceptance.profile_name:
        # The flags as launched (max_model_len capped, eager on a CPU), not only as asked.
        run.write(profile_flags={flag: values[flag] for flag in LAUNCH_FLAGS})
    # Fenced: a runner that lost the acceptance creates no reference server beside the new holder's.
    with run.lease.fenced():
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
            raise AcceptanceStepFailed(
                f"{error.field}: {error.message}" if error.field else error.message
            ) from error
        Deployment.objects.filter(pk=deployment.pk).update(
            desired_state=DesiredState.RUNNING,
            state=DeploymentState.PENDING,
            start_requested_at=timezone.now(),
        )
        run.write(deployment_name=name)
    context.deployment_id = deployment.pk
    outcome = deployment_start(deployment.pk, owner=agent_owner(f"acceptance-{acceptance.pk}"))
    # "busy": another task of this agent took the lease first (supervision); wait for its outcome.
    deadline = time.monotonic() + settings.DEPLOYMENT_READY_TIMEOUT_S + 120
    while True:
        deployment.refresh_from_db()
        if deployment.state in (DeploymentState.SERVING, DeploymentState.FAILED):
            break
        if time.monotonic() > deadline:
            raise AcceptanceStepFailed(
                f"{name} did not reach serving (start: {outcome}, state {deployment.state})"
            )
        run.write()  # progress: still alive
        time.sleep(1)
    if deployment.state == DeploymentState.FAILED:
        raise AcceptanceStepFailed(
            f"{name} failed to start [{deployment.failure_code}]: {deployment.state_reason}"
        )
    ready = deployment.events.filter(step="ready", status="ok").order_by("-at", "-id").first()
    engine_start_s = ready.seconds if ready is not None else None
    run.write(engine_start_s=engine_start_s)
    # The agent runs on the node: the server answers on the loopback whatever address it binds.
    context.local_url = f"http://127.0.0.1:{deployment.port}"
    context.api_key = deployment.engine_api_key  # the engine answers only its deployment's key
    context.profile = profile
    started = f"{engine_start_s:.1f} s" if engine_start_s is not None else "unknown"
    return f"{name} serving at {deployment.endpoint_url}; engine start {started}"


def feature_probe(run: RunningAcceptance, context: AcceptanceContext) -> str:
    """Ask the serving reference engine for what its profile turns on and vLLM marks unsupported on
    Volta (feature_probe.py): a prompt over the token budget, a prompt twice; then its /health."""
    profile, version = context.reference_profile, context.reference_version
    profile_settings, arch = launch_settings(profile).profile, version.arch()
    target = ProbeTarget(
        base_url=context.local_url,
        model=version.name,
        api_key=context.api_key,
        max_num_batched_tokens=profile_settings.resolved_batched_tokens(arch),
        max_model_len=profile_settings.resolved_max_model_len(arch),
        block_size=profile.block_size,
        vocab_size=version.vocab_size,
        timeout_s=REQUEST_TIMEOUT_S,
    )
    outcome = probe_features(target, probed_features(run.acceptance.profile_flags))
    for line in outcome.lines:
        run.note("feature_probe", "info", line)
    if outcome.failure:
        raise AcceptanceStepFailed(outcome.failure)
    return "; ".join(outcome.lines)


# The first level a GPU engine serves ran 12-20 % slower than the next on two of the three engines
# measured for it (docs/gpu-runs.md, 2026-12-04 and 2026-12-07: CUDA loads kernels on first use and
# the host warms up), and the calibration reads the node's host speed off the lowest level. So on a
# GPU a short level goes first and is not recorded. A CPU node's acceptance is not calibrated for speed.
WARM_UP_USERS, WARM_UP_REQUESTS = 4, 8


def _bench_level(
    acceptance: NodeAcceptance,
    context: AcceptanceContext,
    concurrency: int,
    sla: Sla,
    requests: int | None = None,
) -> dict:
    """One closed-loop level through the load generator's own API; the report `manage.py bench
    --json` writes for it (same keys), per-request samples left out. InputError for bad input."""
    requests = requests or acceptance.requests_per_level or requests_per_level_default(concurrency)
    config = BenchConfig(
        base_url=context.local_url,
        model=context.reference_version.name,
        mix=load_mix(acceptance.mix),  # checked when the acceptance was requested
        levels=[LevelPlan(concurrency=concurrency, requests=requests)],
        seed=SEED,
        tokenizer=context.reference_version.path,
        request_timeout_s=REQUEST_TIMEOUT_S,
        slo={"ttft": sla.p95_ttft_s * 1000, "tpot": sla.p95_tpot_s * 1000},
        api_key=context.api_key,
    )
    result = run_blocking(run_sweep(config))
    for level in result.levels:
        level.pop("samples", None)
    sla_concurrency, sla_reason = operating_point(result.levels, sla)
    return {
        "url": context.local_url,
        "model": context.reference_version.name,
        "mix": acceptance.mix,
        "prompt_source": result.prompt_source,
        "prompt_tokens_exact": result.prompt_tokens_exact,
        "levels": result.levels,
        "sla": {"p95_ttft_s": sla.p95_ttft_s, "p95_tpot_s": sla.p95_tpot_s},
        "sla_concurrency": sla_concurrency,
        "sla_reason": sla_reason,
        "error": result.error,
    }


def _checked_level(
    acceptance: NodeAcceptance,
    context: AcceptanceContext,
    concurrency: int,
    sla: Sla,
    requests: int | None = None,
) -> dict:
    """`_bench_level`, its refusals and failed requests turned into a failed step."""
    try:
        result = _bench_level(acceptance, context, concurrency, sla, requests)
    except InputError as error:
        raise AcceptanceStepFailed(f"the bench refused: {error}") from error
    if result["error"]:
        raise AcceptanceStepFailed(f"the bench stopped at {concurrency} users: {result['error']}")
    level = result["levels"][0]
    if not level["completed"] or level["failed"]:
        raise AcceptanceStepFailed(
            f"{level['failed']} of {level['failed'] + level['completed']} requests failed at "
            f"{concurrency} users: {level['errors']}"
        )
    return result


def bench_levels(run: RunningAcceptance, context: AcceptanceContext) -> str:
    """One level at a time (each recorded as it finishes), merged into one `bench --json` report."""
    acceptance = run.acceptance
    sla = Sla()
    report: dict | None = None
    summary = []
    if acceptance.gpu_indices:
        level = _checked_level(acceptance, context, WARM_UP_USERS, sla, WARM_UP_REQUESTS)["levels"][0]
        warm_up = f"{WARM_UP_USERS} users, {level['output_throughput']:.1f} tok/s"
        run.note("bench", "info", f"warm-up level, not recorded: {warm_up}")
    for concurrency in acceptance.concurrency:
        result = _checked_level(acceptance, context, concurrency, sla)
        level = result["levels"][0]
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
    assert report is not None  # one level at least (checked when it was requested)
    report["sla_concurrency"], report["sla_reason"] = operating_point(report["levels"], sla)
    run.write(measured=report)
    context.measured = report
    return "; ".join(summary)


def _sweep_kwargs(run: RunningAcceptance, context: AcceptanceContext) -> dict | None:
    acceptance = run.acceptance
    gpu_key = acceptance.predict_gpu or acceptance.versions.get("gpu_catalog_key", "")
    if not gpu_key:
        return None
    values = knob_values(context.reference_profile)
    # The node's own GPUs run the node's own vLLM (a V1 line on Volta: a slower attention path); a
    # prediction for another GPU (a CPU node's `predict_gpu`) assumes the newest line there.
    engine_version = "" if acceptance.predict_gpu else acceptance.versions.get("vllm", "")
    return {
        "model": context.reference_version.name,
        "gpu": gpu_key,
        "gpus": max(1, len(acceptance.gpu_indices)),
        "mix": acceptance.mix,
        "concurrency": list(acceptance.concurrency),
        "seed": SEED,
        "engine_version": engine_version if engine_line(engine_version) else "",
        **values,
    }


def predict_levels(run: RunningAcceptance, context: AcceptanceContext) -> str:
    kwargs = _sweep_kwargs(run, context)
    if kwargs is None:
        run.write(levels=compare(context.bench_report["levels"], None, None))
        return "no GPU to predict for (a CPU node without a prediction GPU): measured only"
    try:
        predicted = predict.predict_sweep(**kwargs)
    except ApplicationError as error:
        raise AcceptanceStepFailed(f"the simulator refused: {error.field}: {error.message}") from error
    context.predicted = predicted["levels"]
    run.write(levels=compare(context.bench_report["levels"], predicted["levels"], None))
    return f"predicted for {kwargs['gpu']} × {kwargs['gpus']}"


def calibrate_node(run: RunningAcceptance, context: AcceptanceContext) -> str:
    """Fit the node's host costs on the two lowest levels; the others are then predictions the
    fit never saw (the record's evidence that the twin holds). The fit starts from the node's
    previous calibration, so constants this mode cannot show (eager vs CUDA graphs) carry over."""
    kwargs = _sweep_kwargs(run, context)
    if kwargs is None:
        return "skipped: nothing was predicted"
    fit_levels = sorted(run.acceptance.concurrency)[:2]
    try:
        fitted = predict.calibrate_sweep(
            measured=context.measured,
            fit_levels=fit_levels,
            calibration=node_latest_calibration(run.acceptance.node),
            **kwargs,
        )
    except ApplicationError as error:
        raise AcceptanceStepFailed(f"the fit failed: {error.field}: {error.message}") from error
    calibration = fitted["calibration"]
    run.write(
        calibration=calibration,
        levels=compare(
            context.bench_report["levels"], context.predicted, fitted["levels"], fit_levels=fit_levels
        ),
    )
    names = ", ".join(
        f"{name} {value:.4g}" for name, value in sorted(calibration.items()) if isinstance(value, int | float)
    )
    return f"fitted on {fit_levels} users: {names}"


def stop_reference(run: RunningAcceptance, deployment_id: int) -> str:
    """Stop the reference server whatever happened; "" or why it did not stop."""
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
