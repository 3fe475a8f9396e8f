"""The node agent's half of a deployment: start, stop, restart and supervise its server.

These services run *on the node* (the tasks in tasks.py are routed to
`node.<name>`), because they start and signal local processes. Every one of them
first takes the deployment's lease (docs/concurrency.md): a second task for the
same deployment, run twice or concurrently, finds the lease taken and does
nothing, and an agent that lost its lease (it stalled past the expiry and
another agent took over) is fenced out: its writes match no row and it stops
what it launched.

Each step writes a `DeploymentEvent` as it happens, so the deployment page shows
the start progressing; the state a step leaves behind is written under the lease.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from django.conf import settings
from django.db import transaction
from django.db.models import F, Q
from django.utils import timezone

from inference import supervisor
from inference.env_probe import build_advice, missing_kernels
from inference.errors import InputError
from inference.hashing import compare_hashes, hash_model_dir
from inference.startup_errors import classify_startup_log, last_error_line
from inference.vllm_args import ServerArgs, command_line, sim_command, vllm_args, vllm_command
from portal.core.errors import ApplicationError

from .models import Deployment, DeploymentEvent, DeploymentState, DesiredState, EventStatus, MetricsSample

logger = logging.getLogger(__name__)

LOG_NAME = "server.log"
# How far back a failed start's log is read for a known cause: vLLM prints the
# real error before pages of engine-core shutdown noise.
CLASSIFY_BYTES = 256 * 1024
# What a deployment row says about its server once there is none (stopped, failed, restarting).
NO_PROCESS = {"endpoint_url": "", "pid": None, "pgid": None, "process_identity": {}, "serving_since": None}


class LeaseLost(Exception):
    """Another agent holds the deployment now; whatever this one was doing is void."""


class Abandoned(Exception):
    """The desired state changed to stopped while a start was under way."""


class StepFailed(Exception):
    def __init__(self, step: str, message: str, code: str = "") -> None:
        self.step, self.message, self.code = step, message, code or step
        super().__init__(message)


def agent_owner(task_id: str | None = None) -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{task_id or 'direct'}"


# --- Lease -----------------------------------------------------------------------------


@dataclass
class Lease:
    """The right to act on one deployment's process until `lease_expires_at`.

    `token` is the fencing token: every write goes through `write`, which matches
    the row only while its `lease_token` is still ours.
    """

    deployment_id: int
    token: int
    owner: str

    def write(self, **fields) -> None:
        now = timezone.now()
        fields.setdefault("lease_expires_at", now + timedelta(seconds=settings.DEPLOYMENT_LEASE_TTL_S))
        fields["updated_at"] = now
        updated = Deployment.objects.filter(pk=self.deployment_id, lease_token=self.token).update(**fields)
        if updated != 1:
            raise LeaseLost(f"deployment {self.deployment_id}: lease {self.token} was taken over")

    def renew(self) -> None:
        self.write()

    def release(self) -> None:
        Deployment.objects.filter(pk=self.deployment_id, lease_token=self.token).update(
            lease_owner="", lease_expires_at=None
        )


def lease_acquire(deployment_id: int, *, owner: str, wait_s: float = 0.0) -> Lease | None:
    """Take the lease if it is free or expired (bumping the fencing token); None if held.

    One conditional UPDATE is the claim: PostgreSQL re-checks the WHERE clause on
    the row a concurrent claimer just committed, so exactly one of two wins.
    """
    deadline = time.monotonic() + wait_s
    while True:
        now = timezone.now()
        with transaction.atomic():
            claimed = (
                Deployment.objects.filter(pk=deployment_id)
                .filter(Q(lease_expires_at__isnull=True) | Q(lease_expires_at__lt=now))
                .update(
                    lease_token=F("lease_token") + 1,
                    lease_owner=owner,
                    lease_expires_at=now + timedelta(seconds=settings.DEPLOYMENT_LEASE_TTL_S),
                )
            )
            # Read inside the transaction: the token we just wrote, not a later claimer's.
            if claimed == 1:
                token = Deployment.objects.values_list("lease_token", flat=True).get(pk=deployment_id)
                return Lease(deployment_id=deployment_id, token=token, owner=owner)
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.5)


# --- Timeline -----------------------------------------------------------------------------


def event(
    deployment_id: int, step: str, status: str, message: str = "", seconds: float | None = None
) -> None:
    DeploymentEvent.objects.create(
        deployment_id=deployment_id, step=step, status=status, message=message, seconds=seconds
    )


@contextlib.contextmanager
def step(deployment_id: int, name: str, started: str = ""):
    """Time a step and record it: "started" (when it says so), then ok or failed."""
    if started:
        event(deployment_id, name, EventStatus.STARTED, started)
    began = time.monotonic()
    result = {"message": ""}
    try:
        yield result
    except StepFailed as failure:
        event(deployment_id, name, EventStatus.FAILED, failure.message, time.monotonic() - began)
        raise
    event(deployment_id, name, EventStatus.OK, result["message"], time.monotonic() - began)


# --- Start ---------------------------------------------------------------------------------


def _identity(deployment: Deployment) -> supervisor.ProcessIdentity | None:
    """Who the recorded pid/pgid was at launch; signals go to it only while it still is."""
    return supervisor.ProcessIdentity.from_dict(deployment.process_identity)


def _load(deployment_id: int) -> Deployment:
    return Deployment.objects.select_related("node", "profile", "model_version", "team").get(pk=deployment_id)


def deployment_start(deployment_id: int, *, owner: str, reason: str = "") -> str:
    """Bring the deployment to `serving` (or `failed` with a reason). Idempotent."""
    lease = lease_acquire(deployment_id, owner=owner)
    if lease is None:
        return "busy"
    try:
        return _start(lease, reason=reason)
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


def _start(lease: Lease, *, reason: str = "") -> str:
    deployment = _load(lease.deployment_id)
    did = deployment.pk
    if deployment.adopted:
        return "adopted"
    if deployment.desired_state != DesiredState.RUNNING:
        return "not wanted"
    if deployment.state == DeploymentState.SERVING and supervisor.process_alive(
        deployment.pid, _identity(deployment)
    ):
        return "already serving"
    if deployment.state == DeploymentState.FAILED:
        # A failed start is not retried by a leftover message (a double click, a redelivery):
        # a new request, or supervision scheduling a restart, sets the state to pending first.
        return "failed earlier: request a start again"
    if supervisor.group_alive(deployment.pgid, _identity(deployment)):
        # A server from an interrupted start or a half-dead one (API server gone,
        # engine processes left): never run two for one deployment.
        result = supervisor.stop_group(
            deployment.pgid, grace_s=settings.DEPLOYMENT_STOP_GRACE_S, identity=_identity(deployment)
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
        python, result["message"] = _environment(deployment, engine, gpus)

    run_dir = Path(settings.PORTAL_RUN_DIR) / deployment.name
    run_dir.mkdir(parents=True, exist_ok=True)
    with step(did, "hashes", started="hashing the weights and tokenizer on this node") as result:
        model_dir, result["message"] = _model_dir(deployment, engine, run_dir, has_files)

    bind_host, public_host = _hosts(node)
    with step(did, "port") as result:
        port, result["message"] = _choose_port(deployment, bind_host)

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
    supervisor.retire_log(log_path, keep=settings.ENGINE_LOG_KEEP)
    api_key = _api_key(lease, deployment)
    with step(did, "launch") as result:
        try:
            launched = supervisor.launch(
                argv,
                log_path=log_path,
                cuda_visible_devices=",".join(str(i) for i in deployment.gpu_indices),
                cwd=run_dir,
                env=_portal_on_path(),  # the simulator, and vLLM's --middleware inference.vllm_guard
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
    local_url = f"http://{'127.0.0.1' if bind_host in ('0.0.0.0', '') else bind_host}:{port}"  # noqa: S104

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
        from .services import engine_api_key_new

        deployment.engine_api_key = engine_api_key_new()
        lease.write(engine_api_key=deployment.engine_api_key)
    return deployment.engine_api_key


def _portal_on_path() -> dict[str, str]:
    """The simulator (`inference.sim`) and vLLM's guard (`inference.vllm_guard`) are the portal's
    own code: put it on the server's path."""
    path = [str(settings.BASE_DIR), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p)}


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
    from .services import deployment_plan

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
    from portal.inventory.selectors import gpus_in_use

    from .services import team_gpus_held

    team = deployment.team
    held = team_gpus_held(team, exclude_deployment_id=deployment.pk)
    needed = len(deployment.gpu_indices)
    if held + needed > team.gpu_quota:
        raise StepFailed(
            "quota",
            f"team {team.slug} holds {held} of its {team.gpu_quota} GPUs; this deployment needs {needed}",
            "quota",
        )
    taken = {
        i: name
        for i, name in gpus_in_use(deployment.node, exclude_deployment_id=deployment.pk).items()
        if i in deployment.gpu_indices
    }
    if taken:
        listing = ", ".join(f"GPU {i} ({name})" for i, name in sorted(taken.items()))
        raise StepFailed("quota", f"already held by another running deployment: {listing}", "gpus_taken")
    return f"team {team.slug}: {held + needed} of {team.gpu_quota} GPUs"


def _environment(deployment: Deployment, engine: str, gpus) -> tuple[str, str]:
    """The Python to launch with, after checking the node's torch build has the GPUs' kernels."""
    from portal.inventory.services import node_probe_software

    node = deployment.node
    if engine == "sim":
        return sys.executable, "simulator: the portal's own Python; no GPU kernels run, no torch check"
    python = node.vllm_python
    if not python:
        raise StepFailed(
            "environment", f"node {node.name} has no vLLM environment (set vllm_python)", "no_env"
        )
    if not Path(python).exists():
        raise StepFailed("environment", f"{python} does not exist on node {node.name}", "no_env")
    if node.software_python != python or node.software_error or not node.software_probed_at:
        try:
            node_probe_software(node=node)
        except ApplicationError as error:
            raise StepFailed("environment", error.message, "no_env") from error
    facts = f"vLLM {node.vllm_version}, torch {node.torch_version}"
    if not gpus:
        return python, f"{facts}; CPU node: no GPU kernel check"
    if not node.torch_cuda_version:
        raise StepFailed(
            "environment", f"{facts} is a CPU build, but the deployment runs on GPUs", "no_kernel_image"
        )
    missing = missing_kernels(node.torch_arch_list, [g.compute_capability for g in gpus])
    if missing:
        raise StepFailed(
            "environment",
            f"torch {node.torch_version} (CUDA {node.torch_cuda_version}) has no {', '.join(missing)} "
            f"kernels for {gpus[0].name}: {build_advice(missing)}",
            "no_kernel_image",
        )
    return python, f"{facts}, CUDA {node.torch_cuda_version}; kernels for {sm_list(gpus)} present"


def sm_list(gpus) -> str:
    from inference.env_probe import sm_name

    return ", ".join(sorted({sm_name(g.compute_capability) for g in gpus}))


def _model_dir(deployment: Deployment, engine: str, run_dir: Path, has_files: bool) -> tuple[Path, str]:
    """The directory to pass as --model, after checking its files against the release hashes."""
    version = deployment.model_version
    if not has_files:
        if engine == "sim":
            # The simulator needs only the architecture: give it the stored config.json.
            import json

            (run_dir / "config.json").write_text(json.dumps(version.config, indent=2))
            return run_dir, "no model files on this node: the simulator reads the stored config.json"
        where = version.path or "(no path recorded)"
        raise StepFailed(
            "hashes", f"model directory {where} not found on node {deployment.node.name}", "no_model"
        )
    if not version.weights_sha256:
        raise StepFailed(
            "hashes",
            f"{version.name} has no release hashes: record them first "
            f"(manage.py hash_model {version.path} --model {version.name})",
            "no_hashes",
        )
    try:
        actual = hash_model_dir(version.path)
    except InputError as error:
        raise StepFailed("hashes", f"model files: {error.message}", "model_files") from error
    expected = {
        "weights_sha256": version.weights_sha256,
        "tokenizer_sha256": version.tokenizer_sha256,
        "weight_files": version.weight_files,
        "tokenizer_files": version.tokenizer_files,
    }
    problems = compare_hashes(expected, actual)
    if problems:
        raise StepFailed(
            "hashes", "refused: files differ from the release: " + "; ".join(problems), "hash_mismatch"
        )
    count = len(actual.weight_files) + len(actual.tokenizer_files)
    return Path(version.path), f"{count} files match the release ({actual.weights_sha256[:12]})"


def _hosts(node) -> tuple[str, str]:
    """(address vLLM binds, address the portal and gateway reach it at)."""
    host = node.hostname or "127.0.0.1"
    if host in ("127.0.0.1", "localhost"):
        return "127.0.0.1", "127.0.0.1"
    return "0.0.0.0", host  # noqa: S104 - a remote node's server must be reachable by the gateway


def _choose_port(deployment: Deployment, bind_host: str) -> tuple[int, str]:
    """Keep the deployment's port across restarts (the gateway's URL stays), unless it is taken."""
    previous = deployment.port
    if previous and supervisor.wait_port_free(bind_host, previous, timeout_s=3):
        return previous, f"{previous} (as before)"
    port = supervisor.find_free_port(bind_host)
    if previous:
        return port, f"{previous} is taken by another process; using {port}"
    return port, f"{port} (free)"


def _serving(lease: Lease, deployment: Deployment, base_url: str, launch: _Launch, task_began: float) -> None:
    now = timezone.now()
    lease.write(
        state=DeploymentState.SERVING,
        state_reason="",
        endpoint_url=base_url,
        serving_since=now,
        health_failures=0,
        log_tail=supervisor.log_tail(launch.launched.log_path),
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
        tail = supervisor.log_tail(launch.launched.log_path)
    lease.write(
        state=DeploymentState.FAILED,
        state_reason=failure.message,
        failure_code=failure.code,
        **NO_PROCESS,
        log_tail=tail,
    )
    event(deployment.pk, "failed", EventStatus.FAILED, f"[{failure.code}] {failure.message}")


# --- Stop ------------------------------------------------------------------------------------


def deployment_stop(deployment_id: int, *, owner: str, drain: bool = True) -> str:
    """Drain, stop the process group, confirm it is gone and the port free, then `stopped`."""
    # A start holding the lease notices the desired state and gives up within a
    # poll, so waiting for the lease a little is enough.
    lease = lease_acquire(deployment_id, owner=owner, wait_s=min(30, settings.DEPLOYMENT_LEASE_TTL_S))
    if lease is None:
        return "busy"
    try:
        deployment = _load(deployment_id)
        if deployment.desired_state == DesiredState.RUNNING:
            return "wanted running"
        return _stop(lease, deployment, drain=drain, reason="stopped")
    except StepFailed:
        return "failed"
    except LeaseLost:
        return "lease lost"
    finally:
        lease.release()


def _stop(lease: Lease, deployment: Deployment, *, drain: bool, reason: str) -> str:
    did = deployment.pk
    if deployment.adopted:
        event(did, "stop", EventStatus.SKIPPED, "an adopted server is never stopped by the portal")
        return "adopted"
    if not supervisor.group_alive(deployment.pgid, _identity(deployment)):
        if deployment.state != DeploymentState.STOPPED or deployment.pid:
            lease.write(
                state=DeploymentState.STOPPED,
                state_reason=reason,
                **NO_PROCESS,
            )
            event(did, "stop", EventStatus.OK, "no server process was running")
        return "stopped"
    if drain and deployment.state == DeploymentState.SERVING and deployment.endpoint_url:
        # `draining` takes it out of serving_deployments_for_model: the gateway stops routing to it.
        lease.write(state=DeploymentState.DRAINING, state_reason="draining before stop")
        with step(did, "drain", started="no new requests; waiting for in-flight ones") as result:
            result["message"] = _drain(lease, deployment)
    lease.write(state=DeploymentState.STOPPING, state_reason="stopping")
    with step(did, "stop") as result:
        stopped = supervisor.stop_group(
            deployment.pgid,
            grace_s=settings.DEPLOYMENT_STOP_GRACE_S,
            kill_wait_s=15,
            identity=_identity(deployment),
        )
        if not stopped.gone:
            lease.write(
                state=DeploymentState.FAILED, state_reason=f"process group {deployment.pgid} survived SIGKILL"
            )
            raise StepFailed("stop", f"process group {deployment.pgid} survived SIGKILL", "stop")
        bind_host, _ = _hosts(deployment.node)
        port_free = deployment.port is None or supervisor.wait_port_free(
            bind_host, deployment.port, timeout_s=15
        )
        result["message"] = (
            f"{stopped.signal} after {stopped.seconds:.1f} s; process group {deployment.pgid} gone; "
            + (f"port {deployment.port} free" if port_free else f"port {deployment.port} STILL TAKEN")
        )
    lease.write(
        state=DeploymentState.STOPPED,
        state_reason=reason if port_free else f"{reason}; port {deployment.port} is held by another process",
        **NO_PROCESS,
        log_tail=supervisor.log_tail(deployment.log_path),
    )
    return "stopped"


def _drain(lease: Lease, deployment: Deployment) -> str:
    """Wait until vLLM reports no running or waiting request, up to the drain deadline."""
    base = _local_url(deployment)
    began = time.monotonic()
    deadline = began + settings.DEPLOYMENT_DRAIN_TIMEOUT_S
    while True:
        lease.renew()
        metrics = supervisor.scrape_metrics(base, timeout_s=2, api_key=deployment.engine_api_key)
        in_flight = None if metrics is None else (metrics.running or 0) + (metrics.waiting or 0)
        if in_flight == 0:
            return f"no request in flight after {time.monotonic() - began:.1f} s"
        if metrics is None:
            return "no /metrics answer: nothing to wait for"
        if time.monotonic() >= deadline:
            limit = settings.DEPLOYMENT_DRAIN_TIMEOUT_S
            return f"{in_flight:.0f} requests still in flight at the {limit} s deadline"
        time.sleep(0.5)


def _local_url(deployment: Deployment) -> str:
    bind_host, _ = _hosts(deployment.node)
    host = "127.0.0.1" if bind_host == "0.0.0.0" else bind_host  # noqa: S104
    return f"http://{host}:{deployment.port}"


# --- Restart ------------------------------------------------------------------------------------


def deployment_restart(deployment_id: int, *, owner: str, reason: str = "restart requested") -> str:
    """Drain and stop, then start again, under one lease (nobody can slip in between)."""
    lease = lease_acquire(deployment_id, owner=owner, wait_s=min(30, settings.DEPLOYMENT_LEASE_TTL_S))
    if lease is None:
        return "busy"
    try:
        deployment = _load(deployment_id)
        if deployment.adopted or deployment.desired_state != DesiredState.RUNNING:
            return "not restarted"
        event(deployment_id, "restart", EventStatus.STARTED, reason)
        _stop(lease, deployment, drain=True, reason=f"restarting: {reason}")
        return _start(lease, reason=f"restart: {reason}")
    except StepFailed:
        return "failed"
    except LeaseLost:
        return "lease lost"
    finally:
        lease.release()


# --- Supervision ---------------------------------------------------------------------------------


def node_supervise(node_name: str, *, owner: str) -> dict[str, str]:
    """One supervision pass over the node's deployments (a beat tick, run on the node)."""
    deployments = (
        Deployment.objects.filter(node__name=node_name, adopted=False)
        .exclude(desired_state=DesiredState.STOPPED, state=DeploymentState.STOPPED)
        .values_list("pk", "name")
    )
    results = {}
    for pk, name in deployments:
        try:
            results[name] = deployment_supervise(pk, owner=owner)
        except LeaseLost:
            results[name] = "lease lost"
    return results


def deployment_supervise(deployment_id: int, *, owner: str) -> str:
    lease = lease_acquire(deployment_id, owner=owner)
    if lease is None:
        return "busy"  # a start, stop or restart is at work on it
    try:
        return _supervise(lease, _load(deployment_id))
    except StepFailed:
        return "failed"
    finally:
        lease.release()


def _supervise(lease: Lease, deployment: Deployment) -> str:
    state = deployment.state
    if deployment.desired_state == DesiredState.STOPPED:
        return _stop(lease, deployment, drain=False, reason="stopped")
    if state == DeploymentState.FAILED:
        return "failed: not restarted"  # a classified failure repeats; an operator must act
    if state in (DeploymentState.STARTING, DeploymentState.STOPPING, DeploymentState.DRAINING):
        # We hold the lease, so the agent that was doing this is gone (its lease expired).
        return _schedule_restart(lease, deployment, f"the agent was interrupted while {state}")
    if state in (DeploymentState.PENDING, DeploymentState.STOPPED):
        requested = deployment.start_requested_at
        stale = requested is None or timezone.now() - requested > timedelta(seconds=_pending_rescue_s())
        if stale:
            # The start message expired or was lost (agent down when it was sent).
            _enqueue_start(deployment, reason="supervision: wanted running, no start in flight")
            return "start enqueued"
        return "start pending"
    return _check_serving(lease, deployment)


def _pending_rescue_s() -> float:
    return (
        supervisor.restart_backoff_s(
            settings.DEPLOYMENT_RESTART_LIMIT, base_s=settings.DEPLOYMENT_RESTART_BACKOFF_S
        )
        + 120
    )


def _check_serving(lease: Lease, deployment: Deployment) -> str:
    did = deployment.pk
    if not supervisor.process_alive(deployment.pid, _identity(deployment)):
        tail = supervisor.log_tail(deployment.log_path, lines=40)
        lease.write(log_tail=tail)
        return _schedule_restart(lease, deployment, f"the server process {deployment.pid} is gone")
    base = _local_url(deployment)
    key = deployment.engine_api_key
    healthy = supervisor.check_health(base, timeout_s=5, api_key=key)
    metrics = supervisor.scrape_metrics(base, timeout_s=5, api_key=key) if healthy else None
    memory = supervisor.group_rss_mb(deployment.pgid, _identity(deployment))
    if supervisor.rotate_log(
        deployment.log_path, max_bytes=settings.ENGINE_LOG_MAX_BYTES, keep=settings.ENGINE_LOG_KEEP
    ):
        event(did, "log", EventStatus.INFO, f"{LOG_NAME} rotated at {settings.ENGINE_LOG_MAX_BYTES} bytes")
    values = metrics.to_dict() if metrics is not None else {}
    MetricsSample.objects.create(deployment_id=did, healthy=healthy, memory_mb=memory, **values)
    now = timezone.now()
    # Old samples go as new ones arrive (one per tick); the daily retention prune catches the rest.
    if settings.RETENTION_METRICS_SAMPLES_DAYS:
        kept = timedelta(days=settings.RETENTION_METRICS_SAMPLES_DAYS)
        MetricsSample.objects.filter(deployment_id=did, at__lt=now - kept).delete()
    if not healthy:
        failures = deployment.health_failures + 1
        lease.write(health_failures=failures, last_checked_at=now)
        if failures >= settings.DEPLOYMENT_HEALTH_FAILURES:
            return _schedule_restart(lease, deployment, f"/health failed {failures} times in a row (hung)")
        event(did, "health", EventStatus.FAILED, f"/health did not answer ({failures} in a row)")
        return "unhealthy"
    updates = {
        "health_failures": 0,
        "last_checked_at": now,
        "log_tail": supervisor.log_tail(deployment.log_path),
    }
    if deployment.baseline_memory_mb is None and memory is not None:
        updates["baseline_memory_mb"] = memory
    if deployment.baseline_preemptions is None and metrics is not None and metrics.preemptions is not None:
        updates["baseline_preemptions"] = metrics.preemptions
    uptime = (now - deployment.serving_since).total_seconds() if deployment.serving_since else 0.0
    if deployment.restart_count and uptime > 600:
        updates["restart_count"] = 0  # ten quiet minutes: the next crash starts the backoff afresh
    lease.write(**updates)
    policy = supervisor.RestartPolicy(
        max_uptime_hours=deployment.restart_after_hours,
        max_preemptions=deployment.restart_max_preemptions,
        max_memory_growth=deployment.restart_max_memory_growth,
    )
    baseline_preemptions = updates.get("baseline_preemptions", deployment.baseline_preemptions)
    reason = supervisor.planned_restart_reason(
        policy,
        uptime_s=uptime,
        preemptions_since_start=(
            metrics.preemptions - baseline_preemptions
            if metrics is not None and metrics.preemptions is not None and baseline_preemptions is not None
            else None
        ),
        memory_mb=memory,
        baseline_memory_mb=updates.get("baseline_memory_mb", deployment.baseline_memory_mb),
    )
    if reason:
        event(did, "planned restart", EventStatus.INFO, reason)
        from .tasks import restart_deployment

        queue = deployment.node.queue
        transaction.on_commit(
            lambda: restart_deployment.apply_async(
                args=[did], kwargs={"reason": f"planned: {reason}"}, queue=queue, expires=3600
            )
        )
        return "planned restart"
    return "healthy"


def _schedule_restart(lease: Lease, deployment: Deployment, why: str) -> str:
    """Kill what is left of the server and start again after a backoff, up to the limit."""
    did = deployment.pk
    if supervisor.group_alive(deployment.pgid, _identity(deployment)):
        supervisor.stop_group(deployment.pgid, grace_s=5, identity=_identity(deployment))
    attempt = deployment.restart_count + 1
    limit = settings.DEPLOYMENT_RESTART_LIMIT
    if attempt > limit:
        message = f"{why}; restarted {limit} times in a row already, so not again"
        lease.write(
            state=DeploymentState.FAILED,
            state_reason=message,
            failure_code="restart_limit",
            **NO_PROCESS,
        )
        event(did, "failed", EventStatus.FAILED, message)
        return "failed"
    delay = supervisor.restart_backoff_s(attempt, base_s=settings.DEPLOYMENT_RESTART_BACKOFF_S)
    message = f"{why}; restart {attempt} of {limit} in {delay:.0f} s"
    lease.write(
        state=DeploymentState.PENDING,
        state_reason=message,
        restart_count=attempt,
        **NO_PROCESS,
        start_requested_at=timezone.now(),
    )
    event(did, "supervise", EventStatus.FAILED, message)
    _enqueue_start(deployment, reason=f"automatic restart {attempt}: {why}", countdown=delay)
    return "restart scheduled"


def _enqueue_start(deployment: Deployment, *, reason: str, countdown: float = 0) -> None:
    from .tasks import start_deployment

    # on_commit: in a task (autocommit) it is sent at once; inside a transaction, after it commits.
    pk, queue = deployment.pk, deployment.node.queue
    transaction.on_commit(
        lambda: start_deployment.apply_async(
            args=[pk], kwargs={"reason": reason}, queue=queue, countdown=countdown, expires=countdown + 600
        )
    )


def stop_node_servers(node_name: str, *, reason: str) -> int:
    """Stop every server process of the node now (no drain), leaving desired states alone."""
    stopped = 0
    for pk in (
        Deployment.objects.filter(node__name=node_name, adopted=False)
        .exclude(pgid=None)
        .values_list("pk", flat=True)
    ):
        lease = lease_acquire(pk, owner=agent_owner("shutdown"), wait_s=5)
        if lease is None:
            continue
        try:
            _stop(lease, _load(pk), drain=False, reason=reason)
            stopped += 1
        except (StepFailed, LeaseLost):
            pass
        finally:
            lease.release()
    return stopped


# --- Adopted servers -----------------------------------------------------------------------------


def adopted_check(deployment_id: int) -> str:
    """Health-check a server the portal did not start: state mirrors what it answers."""
    deployment = Deployment.objects.filter(pk=deployment_id, adopted=True).first()
    if deployment is None:
        return "not adopted"  # a check sent before the row changed: nothing to watch
    base, key = deployment.endpoint_url, deployment.engine_api_key
    healthy = supervisor.check_health(base, timeout_s=5, api_key=key)
    metrics = supervisor.scrape_metrics(base, timeout_s=5, api_key=key) if healthy else None
    MetricsSample.objects.create(
        deployment_id=deployment_id, healthy=healthy, **(metrics.to_dict() if metrics else {})
    )
    refused = healthy and supervisor.refuses_key(base, api_key=key, timeout_s=5)
    state = DeploymentState.SERVING if healthy and not refused else DeploymentState.FAILED
    reason = "" if state == DeploymentState.SERVING else f"{base}/health does not answer"
    if refused:
        reason = f"{base}/v1 refuses the registered API key (HTTP 401): register the server's key"
    if deployment.state != state:
        Deployment.objects.filter(pk=deployment_id, adopted=True).update(
            state=state, state_reason=reason, last_checked_at=timezone.now()
        )
        event(deployment_id, "health", EventStatus.OK if healthy else EventStatus.FAILED, reason or "answers")
    else:
        Deployment.objects.filter(pk=deployment_id).update(last_checked_at=timezone.now())
    return state
