"""Work drained off a sick GPU (docs/decisions.md, "Deployments on a degraded or lost GPU").

When a node's health sample finds a GPU degraded or lost (portal/inventory/tasks.py), the
`deployments.drain_sick_gpus` task calls `node_drain_sick_gpus`. Each deployment holding such a GPU
is, per its `gpu_failure_policy`:
- `move` (the default): moved to free healthy GPUs of the same kind, on the same node first, then on
  another node (a TP group to the best group that keeps its NVLink ring, docs/gpu-topology.md):
  its own node's agent drains it (the gateway stops routing to it and in-flight requests finish),
  stops it, and points it at the new GPUs (`deployment_relocate`), whose node's
  agent starts it through the normal start. Where no such GPUs are free it is kept and flagged.
- `keep`: kept where it is and flagged; ops decide.
Each decision is a `gpu-health` event on the deployment's timeline and an audit log entry, once
per sickness of the GPU (a failed move is decided again at the next sample).
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from django.db import transaction
from django.utils import timezone

from inference.gpu_health import SICK_STATES
from inference.tp_topology import has_nvlink_ring, ranked_groups
from portal.audit.services import audit_event_record
from portal.core.errors import ApplicationError
from portal.inventory.models import Gpu, GpuHealth, Node
from portal.inventory.selectors import node_topology
from portal.teams.models import Team

from .dispatch import COMMAND_EXPIRES_S, send_to_node
from .models import Deployment, DeploymentEvent, DeploymentState, DesiredState, EventStatus, GpuFailurePolicy
from .placement import holding_problems
from .selectors import gpus_held_on_node

STEP = "gpu-health"


@dataclass(frozen=True)
class DrainDecision:
    deployment: str
    action: str  # "move" | "keep" | "already decided"
    message: str
    target_node: str = ""
    target_gpus: tuple[int, ...] = ()


def _sickness(gpus: list[Gpu]) -> str:
    parts = []
    for gpu in gpus:
        worst = next((f["message"] for f in gpu.health_findings if f.get("level") == gpu.health_state), "")
        parts.append(f"GPU {gpu.index} is {gpu.health_state}" + (f": {worst}" if worst else ""))
    return "; ".join(parts)


def move_target(deployment: Deployment) -> tuple[Node, list[int]] | None:
    """Free healthy GPUs for `deployment`: as many as it holds, of the same kind (nvidia-smi name),
    keeping its NCCL ring on NVLink where its current GPUs do; its own node first, then the others
    by name. Among the groups that qualify, the best by `inference.tp_topology.group_rank` (an
    NVLink ring, a full mesh, one CPU socket), healthy GPUs before warning and unknown ones."""
    home = deployment.placed_node
    current = list(home.gpus.filter(index__in=deployment.gpu_indices))
    if not current:
        return None
    kind, count = current[0].name, len(deployment.gpu_indices)
    wants_ring = count > 1 and has_nvlink_ring(node_topology(home), deployment.gpu_indices)
    nodes = [home, *Node.objects.exclude(pk=home.pk).order_by("name")]
    for node in nodes:
        held = gpus_held_on_node(node, exclude_deployment_id=deployment.pk)
        free = {
            gpu.index: gpu
            for gpu in node.gpus.filter(name=kind).exclude(health_state__in=SICK_STATES)
            if gpu.index not in held
            and not (node.pk == deployment.node_id and gpu.index in deployment.gpu_indices)
        }
        if len(free) < count:
            continue
        topology = node_topology(node)
        groups = ranked_groups(topology, count, among=free)
        if wants_ring:
            groups = [group for group in groups if has_nvlink_ring(topology, group)]
        # Healthy GPUs before warning (throttling, hot) and unknown ones: a move should not land on
        # the next; sorted() is stable, so the topology's order holds within each.
        groups.sort(key=lambda group: sum(free[i].health_state != GpuHealth.HEALTHY for i in group))
        if groups:
            return node, list(groups[0])
    return None


def _decided(deployment: Deployment, since) -> bool:
    """A decision stands for the GPU's current sickness, unless it failed or is a move whose command
    expired unrun (the node's agent was down): those are decided again."""
    latest = (
        DeploymentEvent.objects.filter(deployment=deployment, step=STEP, at__gte=since)
        .order_by("-at", "-id")
        .first()
    )
    if latest is None or latest.status == EventStatus.FAILED:
        return False
    expired = timezone.now() - dt.timedelta(seconds=COMMAND_EXPIRES_S)
    return not (latest.status == EventStatus.INFO and latest.at < expired)


def node_drain_sick_gpus(*, node: Node) -> list[DrainDecision]:
    """Decide, for each deployment holding a degraded or lost GPU of `node`, to move or keep it."""
    sick = {gpu.index: gpu for gpu in node.gpus.filter(health_state__in=SICK_STATES)}
    if not sick:
        return []
    decisions = []
    holders = Deployment.objects.select_related("node", "team").filter(
        node=node, adopted=False, desired_state=DesiredState.RUNNING
    )
    for deployment in holders:
        on_sick = [sick[i] for i in sorted(deployment.gpu_indices) if i in sick]
        if not on_sick:
            continue
        since = max(gpu.health_since or timezone.now() for gpu in on_sick)
        if _decided(deployment, since):
            decisions.append(DrainDecision(deployment.name, "already decided", ""))
            continue
        decisions.append(_decide(deployment, on_sick))
    return decisions


@transaction.atomic
def _decide(deployment: Deployment, on_sick: list[Gpu]) -> DrainDecision:
    why = _sickness(on_sick)
    home = deployment.placed_node
    where = f"{home.name}:{','.join(map(str, deployment.gpu_indices))}"
    if deployment.gpu_failure_policy == GpuFailurePolicy.KEEP:
        message = f"kept on {where} (its GPU failure policy is keep); {why}. Move or stop it by hand."
        return _flag(deployment, message, "keep")
    target = move_target(deployment)
    if target is None:
        message = f"kept on {where}: no free healthy GPUs of its kind to move to; {why}"
        return _flag(deployment, message, "keep")
    node, indices = target
    to = f"{node.name}:{','.join(map(str, indices))}"
    message = f"moving from {where} to {to} (drain, stop, start there); {why}"
    DeploymentEvent.objects.create(deployment=deployment, step=STEP, status=EventStatus.INFO, message=message)
    audit_event_record(
        action="deployment.gpu_move",
        target=deployment,
        changes={"node": [home.name, node.name], "gpu_indices": [deployment.gpu_indices, indices]},
    )
    send_to_node(
        home,
        "deployments.move",
        args=[deployment.pk],
        kwargs={"node_id": node.pk, "gpu_indices": indices, "reason": why},
    )
    return DrainDecision(deployment.name, "move", message, node.name, tuple(indices))


def _flag(deployment: Deployment, message: str, action: str) -> DrainDecision:
    DeploymentEvent.objects.create(
        deployment=deployment, step=STEP, status=EventStatus.SKIPPED, message=message
    )
    audit_event_record(action="deployment.gpu_keep", target=deployment, changes={"reason": message[:500]})
    return DrainDecision(deployment.name, action, message)


@transaction.atomic
def deployment_relocate(
    *, deployment_id: int, node_id: int, gpu_indices: list[int], reason: str
) -> Deployment:
    """Point a stopped deployment at other GPUs and ask their node to start it (the move's second half).

    The target is checked again (it may have been taken, or turned sick, since the decision); a
    refusal raises ApplicationError and leaves the deployment where it was.
    """
    deployment = Deployment.objects.select_for_update().get(pk=deployment_id)
    team = Team.objects.select_for_update().get(pk=deployment.team_id)
    node = Node.objects.select_for_update().get(pk=node_id)
    gpu_indices = sorted(gpu_indices)
    problems = holding_problems(
        team=team, node=node, gpu_indices=gpu_indices, exclude_deployment_id=deployment.pk
    )
    if problems:
        raise ApplicationError(problems[0].message, field="gpu_indices")
    before = f"{deployment.placed_node.name}:{','.join(map(str, deployment.gpu_indices))}"
    after = f"{node.name}:{','.join(map(str, gpu_indices))}"
    Deployment.objects.filter(pk=deployment.pk).update(
        node=node,
        gpu_indices=gpu_indices,
        state=DeploymentState.PENDING,
        state_reason=f"moved from {before} to {after}",
        restart_count=0,
        port=None,
        start_requested_at=timezone.now(),
    )
    DeploymentEvent.objects.create(
        deployment=deployment,
        step=STEP,
        status=EventStatus.OK,
        message=f"moved from {before} to {after}; starting",
    )
    deployment.refresh_from_db()
    send_to_node(
        node, "deployments.start", args=[deployment.pk], kwargs={"reason": f"moved off: {reason}"[:500]}
    )
    return deployment
