"""Start a deployment's server on this node, step by step: validate → quota → environment →
hashes → port → command → launch → ready → warm-up → smoke test → serving (or failed, with the
step and a classified cause). Idempotent: a start finding its server serving does nothing."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from django.conf import settings
from django.utils import timezone

from inference import server_log, supervisor
from inference.errors import InputError
from inference.startup_errors import classify_startup_log, last_error_line
from inference.vllm_args import ServerArgs, command_line, sim_command, vllm_args, vllm_command
from portal.core.errors import ApplicationError

from ..models import Deployment, DeploymentState, DesiredState, EventStatus
from ..placement import holding_problems
from ..selectors import gpus_held_by_team
from ..services import deployment_plan, engine_api_key_new
from .environment import (
    address_check,
    environment_check,
    model_dir_check,
    port_choose,
    portal_on_path,
    server_hosts,
)
from .lease import NO_PROCESS, Lease, LeaseLost, deployment_load, lease_acquire, process_identity
from .steps import StepFailed, event, step

logger = logging.getLogger(__name__)

LOG_NAME = "server.log"
# How far back a failed start's log is read for a known cause: vLLM prints the
# real error before pages of engine-core shutdown noise.
CLASSIFY_BYTES = 256 * 1024


class Abandoned(Exception):
    """The desired state changed to stopped while a start was under way."""


def deployment_start(deployment_id: int, *, owner: str, reason: str = "") -> str:
    """Bring the deployment to `serving` (or `failed` with a reason). Idempotent."""
    lease = lease_acquire(deployment_id, owner=owner)
    if lease is None:
        return "busy"
    try:
        return start_under_lease(lease, reason=reason)
    except LeaseLost:
        logger.warning("deployment %s: lease lost during start", deployment_id)
        return "lease lost"
    finally:
        lease.release()


@dataclass
class _Launch:
    launched: supervisor.Launched | None = None
    process_started: float = 0.0
    ready_s: float | None = None


def start_under_lease(lease: Lease, *, reason: str = "") -> str:
    deployment = deployment_load(lease.deployment_id)
    did = deployment.pk
    if deployment.adopted:
        return "adopted"
    if deployment.desired_state != DesiredState.RUNNING:
        return "not wanted"
    if deployment.state == DeploymentState.SERVING and supervisor.process_alive(
        deployment.pid, process_identity(deployment)
    ):
        return "already serving"
    if deployment.state == DeploymentState.FAILED:
        # A failed start is not retried by a leftover message (a double click, a redelivery):
        # a new request, or supervision scheduling a restart, sets the state to pending first.
        return "failed earlier: request a start again"
    if supervisor.group_alive(deployment.pgid, process_identity(deployment)):
        # A server from an interrupted start or a half-dead one (API server gone,
        # engine processes left): never run two for one deployment.
        result = supervisor.stop_group(
            deployment.pgid, grace_s=settings.DEPLOYMENT_STOP_GRACE_S, identity=process_identity(deployment)
        )
        event(did, "cleanup", EventStatus.OK, f"stopped the previous process group {deployment.pgid}")
        if not result.gone:
            lease.write(
                state=DeploymentState.FAILED, state_reason="a previous server process survived SIGKILL"
            )
            return "failed"
    task_began = time.monotonic()
    lease.write(
        state=DeploymentState.STARTING,
        state_reason=reason,
        failure_code="",
        **NO_PROCESS,
        health_failures=0,
        baseline_memory_mb=None,
        baseline_preemptions=None,
    )
    event(did, "start", EventStatus.STARTED, reason or "start requested")
    launch = _Launch()
    try:
        base_url = _start_steps(lease, deployment, launch)
    except StepFailed as failure:
        _fail(lease, deployment, failure, launch)
        return "failed"
    except Abandoned:
        if launch.launched is not None:
            supervisor.stop_group(
                launch.launched.pgid,
                grace_s=settings.DEPLOYMENT_STOP_GRACE_S,
                identity=launch.launched.identity,
            )
        lease.write(
            state=DeploymentState.STOPPED,
            state_reason="stopped during start",
            pid=None,
            pgid=None,
            process_identity={},
        )
        event(did, "start", EventStatus.SKIPPED, "the deployment was stopped while starting")
        return "abandoned"
    except LeaseLost:
        # Another agent owns the deployment now; a server we launched is not in its
        # record (our write of the pid was fenced out or will be overwritten), so stop it.
        if launch.launched is not None:
            supervisor.stop_group(launch.launched.pgid, grace_s=5, identity=launch.launched.identity)
        raise
    except Exception as error:
        _fail(lease, deployment, StepFailed("start", f"unexpected error: {error!r}", "internal"), launch)
        raise
    _serving(lease, deployment, base_url, launch, task_began)
    return "serving"


def _start_steps(lease: Lease, deployment: Deployment, launch: _Launch) -> str:
    did = deployment.pk
    node, model_version = deployment.node, deployment.model_version
    engine = deployment.effective_engine
    gpus = list(node.gpus.filter(index__in=deployment.gpu_indices).order_by("index"))

    with step(did, "validate") as result:
        result["message"] = _validate(deployment)

    with step(did, "quota") as result:
        result["message"] = _check_quota(deployment)

    has_files = bool(model_version.path) and Path(model_version.path).is_dir()
    with step(did, "environment") as result:
        python, result["message"] = environment_check(deployment, engine, gpus)

    run_dir = Path(settings.PORTAL_RUN_DIR) / deployment.name
    run_dir.mkdir(parents=True, exist_ok=True)
    with step(did, "hashes", started="hashing the weights and tokenizer on this node") as result:
        model_dir, result["message"] = model_dir_check(deployment, engine, run_dir, has_files)

    bind_host, public_host = server_hosts(node)
    with step(did, "address") as result:
        result["message"] = address_check(node)
    with step(did, "port") as result:
        port, result["message"] = port_choose(deployment, bind_host)

    with step(did, "command") as result:
        try:
            args = vllm_args(
                deployment.profile.settings(),
                ServerArgs(
                    model_path=str(model_dir),
                    served_model_name=model_version.name,
                    host=bind_host,
                    port=port,
                ),
                extra_args=deployment.profile.extra_args or [],
                # The simulator takes the newest line's flags; vLLM, its own version's.
                engine_version="" if engine == "sim" else node.vllm_version,
            )
        except InputError as error:
            raise StepFailed("command", str(error), "bad_profile") from error
        if engine == "sim":
            hardware = gpus[0].catalog_key if gpus else deployment.profile.target_gpu
            argv = sim_command(python, args, hardware=hardware or None)
        else:
            argv = vllm_command(python, args, guard=True)
        result["message"] = command_line(argv)

    log_path = run_dir / LOG_NAME
    # The previous run's log becomes server.log.1 (for a post-mortem); older ones shift up.
    server_log.retire_log(log_path, keep=settings.ENGINE_LOG_KEEP)
    api_key = _api_key(lease, deployment)
    with step(did, "launch") as result:
        try:
            launched = supervisor.launch(
                argv,
                log_path=log_path,
                cuda_visible_devices=",".join(str(i) for i in deployment.gpu_indices),
                cwd=run_dir,
                env=portal_on_path(),  # the simulator, and vLLM's --middleware inference.vllm_guard
                api_key=api_key,
            )
        except OSError as error:
            raise StepFailed(
                "launch", f"cannot run {argv[0]}: {error.strerror or error}", "launch"
            ) from error
        launch.launched, launch.process_started = launched, time.monotonic()
        lease.write(
            engine_used=engine,
            command=argv,
            port=port,
            pid=launched.pid,
            pgid=launched.pgid,
            process_identity=launched.identity.to_dict() if launched.identity else {},
            run_dir=str(run_dir),
            log_path=str(log_path),
            launched_at=timezone.now(),
        )
        result["message"] = f"pid {launched.pid} (its own process group), log {log_path}"

    base_url = f"http://{public_host}:{port}"
    local_url = base_url  # checked where the gateway will reach it, not on a loopback of its own

    def keep_going() -> None:
        lease.renew()
        desired = Deployment.objects.filter(pk=did).values_list("desired_state", flat=True).first()
        if desired != DesiredState.RUNNING:
            raise Abandoned()

    with step(did, "ready", started=f"waiting for /health and /v1/models at {base_url}") as result:
        try:
            supervisor.wait_until_ready(
                local_url,
                model_version.name,
                deadline_s=settings.DEPLOYMENT_READY_TIMEOUT_S,
                alive=lambda: launched.process.poll() is None,
                returncode=lambda: launched.process.returncode,
                on_health=lambda: event(did, "health", EventStatus.OK, "/health answers"),
                keep_going=keep_going,
                api_key=api_key,
            )
        except supervisor.ServerExited as error:
            raise _startup_failure(
                log_path, f"the server exited (code {error.returncode}) before it was ready"
            ) from error
        except supervisor.NotReady as error:
            raise _startup_failure(log_path, str(error)) from error
        launch.ready_s = time.monotonic() - launch.process_started
        result["message"] = f"{model_version.name} listed after {launch.ready_s:.1f} s"

    with step(did, "warm-up") as result:
        try:
            result["message"] = f"{supervisor.warm_up(local_url, model_version.name, api_key=api_key):.2f} s"
        except supervisor.SmokeTestFailed as error:
            raise StepFailed("warm-up", str(error), "warm_up_failed") from error

    with step(did, "smoke test") as result:
        try:
            reply = supervisor.smoke_test(
                local_url,
                model_version.name,
                expected_substring=model_version.smoke_expected_substring,
                api_key=api_key,
            )
        except supervisor.SmokeTestFailed as error:
            raise StepFailed("smoke test", str(error), "smoke_test_failed") from error
        result["message"] = f"reply: {reply[:120]!r}"
    return base_url


def _api_key(lease: Lease, deployment: Deployment) -> str:
    """The deployment's server key; one made now for a deployment created before keys were."""
    if not deployment.engine_api_key:
        deployment.engine_api_key = engine_api_key_new()
        lease.write(engine_api_key=deployment.engine_api_key)
    return deployment.engine_api_key


def _startup_failure(log_path: Path, what: str) -> StepFailed:
    text = _read_end(log_path, CLASSIFY_BYTES)
    diagnosis = classify_startup_log(text)
    if diagnosis is not None:
        return StepFailed("ready", diagnosis.reason(), diagnosis.code)
    last = last_error_line(text)
    return StepFailed("ready", f"{what}; last error in the log: {last or '(none)'}", "exited")


def _read_end(path: Path, size: int) -> str:
    try:
        with open(path, "rb") as log:
            log.seek(max(0, path.stat().st_size - size))
            return log.read().decode("utf-8", errors="replace")
    except OSError:
        return ""


def _validate(deployment: Deployment) -> str:
    try:
        plan = deployment_plan(deployment)
    except ApplicationError as error:
        raise StepFailed("validate", error.message, "invalid") from error
    if plan is None:
        return "CPU node: the GPU planner does not apply"
    errors = [f for f in plan.findings if f.level == "error"]
    if errors:
        raise StepFailed(
            "validate", "the planner refuses this profile: " + "; ".join(f.message for f in errors), "planner"
        )
    warnings = [f.code for f in plan.findings if f.level == "warning"]
    return "planner: ok" + (f" (warnings: {', '.join(warnings)})" if warnings else "")


def _check_quota(deployment: Deployment) -> str:
    """The placement again, on the node: its GPUs may have been taken since the request."""
    team, needed = deployment.team, len(deployment.gpu_indices)
    problems = holding_problems(
        team=team,
        node=deployment.node,
        gpu_indices=deployment.gpu_indices,
        exclude_deployment_id=deployment.pk,
    )
    if problems:
        raise StepFailed("quota", problems[0].message, problems[0].code)
    held = gpus_held_by_team(team, exclude_deployment_id=deployment.pk)
    return f"team {team.slug}: {held + needed} of {team.gpu_quota} GPUs"


def _serving(lease: Lease, deployment: Deployment, base_url: str, launch: _Launch, task_began: float) -> None:
    now = timezone.now()
    lease.write(
        state=DeploymentState.SERVING,
        state_reason="",
        endpoint_url=base_url,
        serving_since=now,
        health_failures=0,
        log_tail=server_log.log_tail(launch.launched.log_path),
    )
    message = f"serving at {base_url}"
    requested = Deployment.objects.values_list("start_requested_at", flat=True).get(pk=deployment.pk)
    ready_s = launch.ready_s
    if requested is not None and ready_s is not None:
        total = (now - requested).total_seconds()
        message += (
            f": {total:.1f} s from the request (engine start-up {ready_s:.1f} s, "
            f"everything else {total - ready_s:.1f} s)"
        )
    event(deployment.pk, "serving", EventStatus.OK, message, time.monotonic() - task_began)


def _fail(lease: Lease, deployment: Deployment, failure: StepFailed, launch: _Launch) -> None:
    tail = ""
    if launch.launched is not None:
        if supervisor.group_alive(launch.launched.pgid, launch.launched.identity):
            supervisor.stop_group(
                launch.launched.pgid,
                grace_s=settings.DEPLOYMENT_STOP_GRACE_S,
                identity=launch.launched.identity,
            )
        tail = server_log.log_tail(launch.launched.log_path)
    lease.write(
        state=DeploymentState.FAILED,
        state_reason=failure.message,
        failure_code=failure.code,
        **NO_PROCESS,
        log_tail=tail,
    )
    event(deployment.pk, "failed", EventStatus.FAILED, f"[{failure.code}] {failure.message}")
