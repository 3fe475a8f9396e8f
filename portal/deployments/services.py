"""Planning and writes for deployment profiles and deployments."""

from __future__ import annotations

import re
import secrets
from pathlib import Path
from urllib.parse import urlsplit

from django.db import DatabaseError, transaction
from django.db.models import Q
from django.utils import timezone

from inference.engines import LINES, engine_line
from inference.errors import InputError
from inference.hardware import GpuSpec, get_gpu
from inference.hf_config import known_configs, resolve_model_config
from inference.modelspec import ModelArch
from inference.planner import Placement, Plan, plan_deployment
from inference.tp_topology import advise_tp_group, has_nvlink_ring
from portal.audit.services import audit_event_record
from portal.core.errors import ApplicationError, clean_or_raise
from portal.inventory.models import Node
from portal.inventory.selectors import node_topology
from portal.registry.models import ModelVersion
from portal.teams.models import Team

from .dispatch import send_to_control, send_to_node
from .endpoints import check_adoptable_host
from .launch import launch_settings, settings_from
from .models import (
    Deployment,
    DeploymentEvent,
    DeploymentProfile,
    DeploymentState,
    DesiredState,
    EventStatus,
    GpuFailurePolicy,
)
from .placement import holding_problems

# Where a deployment runs; fixed once it exists (a new placement is a new deployment).
DEPLOYMENT_PLACEMENT_FIELDS = ("name", "team", "model_version", "profile", "node", "gpu_indices")
DEPLOYMENT_CREATE_FIELDS = (
    *DEPLOYMENT_PLACEMENT_FIELDS,
    "desired_state",
    "concurrency_cap",
    "shared",
    "gpu_failure_policy",
)


# What an adopted server's key may be: it travels in an HTTP header, so visible ASCII, no spaces.
_API_KEY_RE = re.compile(r"^[\x21-\x7e]{1,200}$")


def engine_api_key_new() -> str:
    """A fresh per-deployment secret for the server's VLLM_API_KEY (256 bits)."""
    return secrets.token_urlsafe(32)


def engine_api_key_clean(value: str) -> str:
    """An adopted server's key as given ("" = the server wants none); refuses what a header cannot carry."""
    value = (value or "").strip()
    if value and not _API_KEY_RE.match(value):
        raise ApplicationError(
            "api_key must be 1 to 200 visible ASCII characters without spaces", field="api_key"
        )
    return value


def planned_arch(model_version: ModelVersion) -> ModelArch:
    """The architecture the planner works from; an external version has none to plan with."""
    if model_version.external:
        raise ApplicationError(
            f"{model_version.name} was recorded from a running server, so its architecture is unknown; "
            "register it from its config.json (manage.py register_model) to plan it",
            field="model_version",
        )
    return model_version.arch()


def plan_for(*, model_version: ModelVersion, profile: DeploymentProfile, placement: Placement) -> Plan:
    return plan_deployment(planned_arch(model_version), launch_settings(profile).profile, placement)


def target_placement(
    *, gpu_key: str, gpu_count: int, nvlink_connected: bool | None = None, engine_version: str = ""
) -> Placement:
    """A placement on catalog GPUs (no node yet). SXM boards are assumed NVLinked, PCIe cards not.
    `engine_version`: the vLLM version the GPUs would run ("": the newest line)."""
    try:
        gpu = get_gpu(gpu_key)
    except InputError as error:
        raise ApplicationError.from_input_error(error) from error
    if gpu_count < 1:
        raise ApplicationError("must be at least 1", field="gpus")
    if nvlink_connected is None and gpu_count > 1:
        nvlink_connected = gpu.nvlink_gb_s is not None
    if len(engine_version) > 50 or (engine_version and engine_line(engine_version) is None):
        raise ApplicationError(
            f"unknown vLLM version {engine_version[:50]!r}; known lines: "
            + ", ".join(line.label() for line in LINES),
            field="engine_version",
        )
    return Placement(
        gpu=gpu, gpu_count=gpu_count, nvlink_connected=nvlink_connected, engine_version=engine_version
    )


def plan_on_catalog_gpus(
    *,
    model: str,
    gpu: str,
    gpus: int,
    nvlink: bool | None = None,
    allow_paths: bool = False,
    engine_version: str = "",
    **settings_values,
) -> Plan:
    """A plan from loose values: the plan command, the plan API and the planner page.

    The tensor-parallel size defaults to all the GPUs, as `plan` does (docs/architecture.md#contracts).
    """
    placement = target_placement(
        gpu_key=gpu, gpu_count=gpus, nvlink_connected=nvlink, engine_version=engine_version
    )
    arch = resolve_model(model, allow_paths=allow_paths)
    if not settings_values.get("tensor_parallel_size"):
        settings_values["tensor_parallel_size"] = gpus
    return plan_deployment(arch, settings_from(**settings_values), placement)


def profile_plan(profile: DeploymentProfile) -> Plan | None:
    """The plan against the profile's own target, or None when it names no model (or an external
    one) or no GPU."""
    if profile.model_version is None or profile.model_version.external or not profile.target_gpu:
        return None
    placement = target_placement(gpu_key=profile.target_gpu, gpu_count=profile.target_gpu_count)
    return plan_for(model_version=profile.model_version, profile=profile, placement=placement)


def node_placement(*, node: Node, gpu_indices: list[int]) -> Placement | None:
    """A placement on real GPUs of a node; None on a CPU-only node (the planner does not apply)."""
    gpus = {gpu.index: gpu for gpu in node.gpus.all()}
    if not gpus:
        if gpu_indices:
            raise ApplicationError(f"node {node.name} has no GPUs", field="gpu_indices")
        return None
    unknown = sorted(set(gpu_indices) - set(gpus))
    if unknown:
        raise ApplicationError(
            f"node {node.name} has no GPU {unknown}; it has {sorted(gpus)}", field="gpu_indices"
        )
    if not gpu_indices:
        raise ApplicationError("choose the GPUs to run on", field="gpu_indices")
    chosen = [gpus[i] for i in gpu_indices]
    specs: list[GpuSpec] = [gpu.spec() for gpu in chosen]
    if len({(s.key, s.memory_gib) for s in specs}) > 1:
        raise ApplicationError("a deployment's GPUs must all be the same model", field="gpu_indices")
    engine_version = node.vllm_version if node.engine == "vllm" else ""
    if len(chosen) < 2:
        return Placement(gpu=specs[0], gpu_count=1, engine_version=engine_version)
    topology = node_topology(node, list(gpus.values()))
    return Placement(
        gpu=specs[0],
        gpu_count=len(chosen),
        # An NCCL ring on NVLink: a direct link for a pair, a cycle through all of a larger group.
        nvlink_connected=has_nvlink_ring(topology, gpu_indices),
        topology_findings=tuple(advise_tp_group(topology, gpu_indices)),
        engine_version=engine_version,
    )


def deployment_plan(deployment: Deployment) -> Plan | None:
    if deployment.adopted or deployment.node is None or deployment.profile is None:
        return None
    placement = node_placement(node=deployment.node, gpu_indices=deployment.gpu_indices)
    if placement is None:
        return None
    return plan_for(model_version=deployment.model_version, profile=deployment.profile, placement=placement)


def deployment_check(
    *,
    team: Team,
    model_version: ModelVersion,
    profile: DeploymentProfile,
    node: Node,
    gpu_indices: list[int],
    desired_state: str = DesiredState.RUNNING,
) -> None:
    """Refuse a placement that cannot work; raises ApplicationError naming the field.

    Refused: GPUs the node lacks or another running deployment holds, a GPU count
    other than the tensor-parallel size, a team over its GPU quota, and any
    planner error (the findings ride along in the error's `extra`).
    """
    if len(set(gpu_indices)) != len(gpu_indices):
        raise ApplicationError("a GPU is listed twice", field="gpu_indices")
    placement = node_placement(node=node, gpu_indices=gpu_indices)
    if placement is not None:
        settings = launch_settings(profile).profile
        if len(gpu_indices) != settings.tensor_parallel_size:
            raise ApplicationError(
                f"profile {profile.name} uses tensor parallel size {settings.tensor_parallel_size}, "
                f"so choose exactly that many GPUs (got {len(gpu_indices)})",
                field="gpu_indices",
            )
        plan = plan_deployment(planned_arch(model_version), settings, placement)
        errors = [f for f in plan.findings if f.level == "error"]
        if errors:
            raise ApplicationError(
                "the planner refuses this deployment: " + "; ".join(f.message for f in errors),
                field="profile",
                extra={"findings": [f.to_dict() for f in plan.findings]},
            )
    if desired_state == DesiredState.RUNNING:
        _check_holding(team=team, node=node, gpu_indices=gpu_indices)


@transaction.atomic
def deployment_create(
    *,
    name: str,
    team: Team,
    model_version: ModelVersion,
    profile: DeploymentProfile,
    node: Node,
    gpu_indices: list[int],
    desired_state: str = DesiredState.RUNNING,
    concurrency_cap: int | None = None,
    shared: bool = False,
    gpu_failure_policy: str = GpuFailurePolicy.MOVE,
) -> Deployment:
    """Place a profile and model version on a node's GPUs after `deployment_check`.

    The team and node rows are locked first, so two concurrent creations cannot
    both pass the quota or free-GPU checks.
    """
    team = Team.objects.select_for_update().get(pk=team.pk)
    node = Node.objects.select_for_update().get(pk=node.pk)
    gpu_indices = sorted(gpu_indices)
    deployment_check(
        team=team,
        model_version=model_version,
        profile=profile,
        node=node,
        gpu_indices=gpu_indices,
        desired_state=desired_state,
    )
    running = desired_state == DesiredState.RUNNING
    deployment = Deployment(
        name=name,
        team=team,
        model_version=model_version,
        profile=profile,
        node=node,
        gpu_indices=gpu_indices,
        desired_state=desired_state,
        state=DeploymentState.PENDING if running else DeploymentState.STOPPED,
        concurrency_cap=concurrency_cap,
        shared=shared,
        gpu_failure_policy=gpu_failure_policy,
        start_requested_at=timezone.now() if running else None,
        engine_api_key=engine_api_key_new(),
    )
    clean_or_raise(deployment)
    deployment.save()
    _event(
        deployment, "created", f"on {node.name} GPUs {gpu_indices or 'none (CPU)'}, wanted {desired_state}"
    )
    audit_event_record(
        action="deployment.create",
        target=deployment,
        changes={"team": team.slug, "node": node.name, "gpu_indices": gpu_indices, "shared": shared},
    )
    if running:
        _send(deployment, "start", reason="deployed")
    return deployment


def _check_holding(
    *, team: Team, node: Node, gpu_indices: list[int], exclude_deployment_id: int | None = None
) -> None:
    """Refuse GPUs another running deployment holds, or a team over its GPU quota."""
    problems = holding_problems(
        team=team, node=node, gpu_indices=gpu_indices, exclude_deployment_id=exclude_deployment_id
    )
    if problems:
        raise ApplicationError(problems[0].message, field=problems[0].field)


def resolve_model(name_or_path: str, *, allow_paths: bool = False) -> ModelArch:
    """A registered model version by name, else a bundled config by name.

    Paths to a config.json are accepted only from the command line
    (`allow_paths`): over the API they would let a caller probe the server's files.
    """
    try:
        version = ModelVersion.objects.filter(name=name_or_path).first()
    except DatabaseError as error:
        # A fresh clone (no migrate yet) still plans a bundled config or a config.json path.
        if name_or_path in known_configs() or (allow_paths and Path(name_or_path).exists()):
            return resolve_model_config(name_or_path)
        raise ApplicationError(
            f"'{name_or_path[:100]}' is not a bundled config, and registered models cannot be read "
            "(run `python manage.py migrate` first)",
            field="model",
        ) from error
    if version is not None:
        return planned_arch(version)
    if not allow_paths and name_or_path not in known_configs():
        # Only names: a relative path ("models", "..") would still reach the filesystem, and
        # the answer would say which of the server's directories exist.
        raise ApplicationError(
            f"'{name_or_path[:100]}' is neither a registered model version nor a bundled config; "
            f"bundled: {', '.join(known_configs())}",
            field="model",
        )
    try:
        return resolve_model_config(name_or_path)
    except InputError as error:
        raise ApplicationError(
            f"'{name_or_path}' is not a registered model version; {error.message}", field="model"
        ) from error


# Bounds of a deployment's SLA (seconds): above them no request would ever count as slow.
SLA_TTFT_MAX_S = 600.0
SLA_TPOT_MAX_S = 60.0


def sla_check(*, p95_ttft_s: float, p95_tpot_s: float) -> None:
    """Refuse an SLA outside (0, max], naming the field."""
    for field, value, top in (
        ("sla_p95_ttft_s", p95_ttft_s, SLA_TTFT_MAX_S),
        ("sla_p95_tpot_s", p95_tpot_s, SLA_TPOT_MAX_S),
    ):
        if not 0 < value <= top:
            raise ApplicationError(f"{field} must be more than 0 and at most {top:g} seconds.", field=field)


def deployment_set_sla(
    *, deployment: Deployment, p95_ttft_s: float, p95_tpot_s: float, user=None
) -> Deployment:
    """Set the SLA that production latency (and new benchmark runs) of the deployment are judged by."""
    sla_check(p95_ttft_s=p95_ttft_s, p95_tpot_s=p95_tpot_s)
    before = [deployment.sla_p95_ttft_s, deployment.sla_p95_tpot_s]
    Deployment.objects.filter(pk=deployment.pk).update(sla_p95_ttft_s=p95_ttft_s, sla_p95_tpot_s=p95_tpot_s)
    audit_event_record(
        action="deployment.set_sla",
        target=deployment,
        actor=user,
        changes={"sla_p95_ttft_s": [before[0], p95_ttft_s], "sla_p95_tpot_s": [before[1], p95_tpot_s]},
    )
    deployment.sla_p95_ttft_s, deployment.sla_p95_tpot_s = p95_ttft_s, p95_tpot_s
    return deployment


def deployment_set_concurrency_cap(*, deployment: Deployment, cap: int | None, source: str) -> Deployment:
    """Set the gateway's in-flight cap for a deployment and say where it came from.

    The gateway reads `concurrency_cap`; `source` is shown beside it ("benchmark run 12:
    highest level meeting P95 TTFT ≤ 3 s and P95 TPOT ≤ 0.2 s", "set by alice").
    """
    if cap is not None and cap < 1:
        raise ApplicationError(
            "The concurrency cap must be at least 1 (blank for none).", field="concurrency_cap"
        )
    before = deployment.concurrency_cap
    Deployment.objects.filter(pk=deployment.pk).update(concurrency_cap=cap, concurrency_cap_source=source)
    audit_event_record(
        action="deployment.set_cap",
        target=deployment,
        changes={"concurrency_cap": [before, cap], "source": source},
    )
    deployment.concurrency_cap = cap
    deployment.concurrency_cap_source = source
    return deployment


# --- Lifecycle requests (the control side; the node agent does the work) ---------


def _event(deployment: Deployment, step: str, message: str) -> None:
    DeploymentEvent.objects.create(deployment=deployment, step=step, status=EventStatus.INFO, message=message)


def _send(deployment: Deployment, action: str, **kwargs) -> None:
    """Ask the deployment's node to `action` it once the request is committed (the message
    expires: supervision reconciles from the desired state instead; portal/deployments/dispatch.py)."""
    send_to_node(deployment.placed_node, f"deployments.{action}", args=[deployment.pk], kwargs=kwargs)


def _who(user) -> str:
    return f" by {user.get_username()}" if user is not None else ""


def _refuse_adopted(deployment: Deployment) -> None:
    if deployment.adopted:
        raise ApplicationError(
            "an adopted server is never started or stopped by the portal; it is only health-checked",
            field="desired_state",
        )


@transaction.atomic
def deployment_request_start(*, deployment: Deployment, user=None) -> Deployment:
    """Want it running: check it may hold its GPUs again, then ask its node to start it."""
    _refuse_adopted(deployment)
    team = Team.objects.select_for_update().get(pk=deployment.team_id)
    assert deployment.node_id is not None  # not adopted: the portal placed it
    node = Node.objects.select_for_update().get(pk=deployment.node_id)
    if deployment.desired_state != DesiredState.RUNNING:
        _check_holding(
            team=team, node=node, gpu_indices=deployment.gpu_indices, exclude_deployment_id=deployment.pk
        )
    updates = {
        "desired_state": DesiredState.RUNNING,
        "restart_count": 0,
        "start_requested_at": timezone.now(),
    }
    # Serving stays serving (the start is then a no-op); anything else waits for the agent.
    Deployment.objects.filter(pk=deployment.pk).exclude(state=DeploymentState.SERVING).update(
        state=DeploymentState.PENDING, state_reason=f"start requested{_who(user)}"
    )
    Deployment.objects.filter(pk=deployment.pk).update(**updates)
    _event(deployment, "request", f"start requested{_who(user)}")
    audit_event_record(action="deployment.start", target=deployment, actor=user)
    _send(deployment, "start", reason=f"start requested{_who(user)}")
    deployment.refresh_from_db()
    return deployment


@transaction.atomic
def deployment_request_stop(*, deployment: Deployment, user=None) -> Deployment:
    """Want it stopped: the agent drains it, stops the process group and frees the port."""
    _refuse_adopted(deployment)
    Deployment.objects.filter(pk=deployment.pk).update(desired_state=DesiredState.STOPPED)
    # Nothing can be running when no process was ever recorded and no agent holds the
    # lease: say `stopped` now rather than wait for an agent (which may be down).
    now = timezone.now()
    Deployment.objects.filter(
        Q(lease_expires_at__isnull=True) | Q(lease_expires_at__lt=now),
        pk=deployment.pk,
        pid__isnull=True,
        state__in=[DeploymentState.PENDING, DeploymentState.FAILED],
    ).update(state=DeploymentState.STOPPED, state_reason=f"stopped{_who(user)}")
    _event(deployment, "request", f"stop requested{_who(user)}")
    audit_event_record(action="deployment.stop", target=deployment, actor=user)
    _send(deployment, "stop")
    deployment.refresh_from_db()
    return deployment


@transaction.atomic
def deployment_request_restart(*, deployment: Deployment, user=None) -> Deployment:
    _refuse_adopted(deployment)
    if deployment.desired_state != DesiredState.RUNNING:
        raise ApplicationError("the deployment is stopped: start it instead", field="desired_state")
    Deployment.objects.filter(pk=deployment.pk).update(restart_count=0, start_requested_at=timezone.now())
    _event(deployment, "request", f"restart requested{_who(user)}")
    audit_event_record(action="deployment.restart", target=deployment, actor=user)
    _send(deployment, "restart", reason=f"restart requested{_who(user)}")
    deployment.refresh_from_db()
    return deployment


def endpoint_url_from(url: str) -> str:
    """`http://host:port/v1` (what OpenAI clients are given) → the server root the portal stores."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ApplicationError(f"not an http(s) URL: {url!r}", field="url")
    if parts.query or parts.fragment:
        raise ApplicationError("give the server URL without a query or fragment", field="url")
    path = parts.path.rstrip("/")
    if path.endswith("/v1"):
        path = path[: -len("/v1")]
    if path:
        raise ApplicationError(f"expected http://host:port or http://host:port/v1, got {url!r}", field="url")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError as error:
        raise ApplicationError(f"not a valid port in {url!r}", field="url") from error
    check_adoptable_host(parts.hostname, port)
    return f"{parts.scheme}://{parts.netloc}"


@transaction.atomic
def endpoint_register(
    *,
    name: str,
    team: Team,
    model_version: ModelVersion,
    url: str,
    node: Node | None = None,
    shared: bool = False,
    api_key: str = "",
) -> Deployment:
    """Record a vLLM server the portal did not start (`register_endpoint`).

    It serves `model_version` under its name, so the gateway routes to it and
    benchmarks can target it; supervision only health-checks it. `api_key` is the
    key it was started with (`--api-key` / VLLM_API_KEY), sent as a bearer token.
    """
    endpoint = endpoint_url_from(url)
    api_key = engine_api_key_clean(api_key)
    if Deployment.objects.filter(adopted=True, endpoint_url=endpoint).exists():
        raise ApplicationError(f"{endpoint} is already registered", field="url")
    deployment = Deployment(
        name=name,
        team=team,
        model_version=model_version,
        node=node,
        adopted=True,
        shared=shared,
        desired_state=DesiredState.RUNNING,
        state=DeploymentState.PENDING,
        state_reason="adopted: waiting for the first health check",
        endpoint_url=endpoint,
        engine_used="external",
        engine_api_key=api_key,
    )
    clean_or_raise(deployment)
    deployment.save()
    _event(deployment, "adopted", f"registered {endpoint} serving {model_version.name}")
    audit_event_record(
        action="deployment.register_endpoint",
        target=deployment,
        changes={
            "team": team.slug,
            "endpoint_url": endpoint,
            "shared": shared,
            "with_api_key": bool(api_key),
        },
    )
    send_to_control("deployments.check_adopted", args=[deployment.pk])
    return deployment


def deployment_delete(*, deployment: Deployment) -> None:
    """Delete a deployment whose server is gone (or an adopted one): never orphan a process."""
    if not deployment.adopted and (
        deployment.desired_state == DesiredState.RUNNING
        or deployment.state not in (DeploymentState.STOPPED, DeploymentState.FAILED, DeploymentState.PENDING)
        or deployment.pid
    ):
        raise ApplicationError("stop the deployment first; its server may still be running", field="state")
    target_type, target_id = deployment._meta.label_lower, str(deployment.pk)  # no pk once deleted
    deployment.delete()
    audit_event_record(
        action="deployment.delete", target_repr=deployment.name, target_type=target_type, target_id=target_id
    )
