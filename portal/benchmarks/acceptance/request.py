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
from inference.loadgen.workloads import load_mix
from inference.tiny_model import resolve_shape
from portal.audit.services import audit_event_record
from portal.core.errors import ApplicationError
from portal.deployments.models import Deployment, DesiredState
from portal.deployments.selectors import gpus_held_on_node
from portal.deployments.services import deployment_request_stop
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
    profile: str | None = None,
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
