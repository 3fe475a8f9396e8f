"""Deployment tasks. They take IDs and call the node agent (`portal/deployments/agent/`).

start / stop / restart / supervise_node run on the deployment's node (sent with
`portal.deployments.dispatch.send_to_node`): they start and signal local processes. supervise_all runs
on `control` from beat and fans out one supervise_node per node, plus the health
checks of adopted servers (plain HTTP, no process to watch).

The node tasks are `acks_late`: each takes the deployment's lease first, so a
message redelivered after its worker died resumes the work (the dead worker's
lease has expired) and a duplicate is a no-op. They retry only the database's
transient errors, a bounded number of times.
"""

from __future__ import annotations

from typing import Any

from celery import shared_task
from celery.signals import worker_shutdown
from django.db import InterfaceError, OperationalError

from portal.core.tasking import skip_missing_row

# A database connection lost mid-task (PostgreSQL restarted, a network blip):
# the only errors worth trying again; everything else is recorded as a failure.
TRANSIENT_ERRORS = (OperationalError, InterfaceError)
NODE_TASK_OPTIONS: dict[str, Any] = {
    "acks_late": True,
    "autoretry_for": TRANSIENT_ERRORS,
    "retry_backoff": 5,
    "retry_backoff_max": 60,
    "max_retries": 3,
}


def _owner(task) -> str:
    from .agent.lease import agent_owner

    return agent_owner(task.request.id)


@shared_task(bind=True, name="deployments.start", **NODE_TASK_OPTIONS)
@skip_missing_row("deployments.Deployment", arg="deployment_id")
def start_deployment(self, deployment_id: int, reason: str = "") -> str | None:
    from .agent.start import deployment_start

    return deployment_start(deployment_id, owner=_owner(self), reason=reason)


@shared_task(bind=True, name="deployments.stop", **NODE_TASK_OPTIONS)
@skip_missing_row("deployments.Deployment", arg="deployment_id")
def stop_deployment(self, deployment_id: int) -> str | None:
    from .agent.stop import deployment_stop

    return deployment_stop(deployment_id, owner=_owner(self))


@shared_task(bind=True, name="deployments.restart", **NODE_TASK_OPTIONS)
@skip_missing_row("deployments.Deployment", arg="deployment_id")
def restart_deployment(self, deployment_id: int, reason: str = "restart requested") -> str | None:
    from .agent.restart import deployment_restart

    return deployment_restart(deployment_id, owner=_owner(self), reason=reason)


@shared_task(bind=True, name="deployments.move", **NODE_TASK_OPTIONS)
@skip_missing_row("deployments.Deployment", arg="deployment_id")
def move_deployment(
    self, deployment_id: int, node_id: int, gpu_indices: list[int], reason: str = ""
) -> str | None:
    """Drain and stop the deployment here, then hand it to the node of `gpu_indices` (gpu_drain.py)."""
    from .agent.move import deployment_move

    return deployment_move(
        deployment_id, owner=_owner(self), node_id=node_id, gpu_indices=gpu_indices, reason=reason
    )


@shared_task(name="deployments.drain_sick_gpus")
def drain_sick_gpus(node_name: str) -> list[str]:
    """Move or keep-and-flag the deployments on the node's degraded or lost GPUs (on control)."""
    from portal.inventory.models import Node

    from .gpu_drain import node_drain_sick_gpus

    node = Node.objects.filter(name=node_name).first()
    if node is None:
        return []
    return [f"{d.deployment}: {d.action}" for d in node_drain_sick_gpus(node=node)]


@shared_task(bind=True, name="deployments.supervise_node", acks_late=False)
def supervise_node(self, node_name: str) -> dict[str, str]:
    """One supervision pass on the node (not retried: the next beat tick is the retry)."""
    from .agent.supervise import node_supervise

    return node_supervise(node_name, owner=_owner(self))


@shared_task(name="deployments.check_adopted")
@skip_missing_row("deployments.Deployment", arg="deployment_id")
def check_adopted(deployment_id: int) -> str | None:
    from .agent.adopted import adopted_check

    return adopted_check(deployment_id)


@shared_task(name="deployments.supervise_all")
def supervise_all() -> int:
    """Beat: send a supervision pass to every node with a deployment to watch."""
    from portal.inventory.models import Node

    from .dispatch import send_to_control, send_to_node
    from .models import Deployment, DeploymentState, DesiredState

    watched = Deployment.objects.filter(adopted=False).exclude(
        desired_state=DesiredState.STOPPED, state=DeploymentState.STOPPED
    )
    nodes = Node.objects.filter(deployments__in=watched).distinct()
    for node in nodes:
        send_to_node(node, "deployments.supervise_node", args=[node.name])
    for pk in Deployment.objects.filter(adopted=True).values_list("pk", flat=True):
        send_to_control("deployments.check_adopted", args=[pk])
    return len(nodes)


@worker_shutdown.connect
def stop_local_servers(**_kwargs) -> None:
    """With PORTAL_AGENT_STOP_SERVERS_ON_EXIT (make run's agent), stop this node's servers on exit.

    Their desired state stays `running`, so the next `make run` starts them again.
    """
    from django.conf import settings

    if not settings.PORTAL_AGENT_STOP_SERVERS_ON_EXIT:
        return
    from .agent.stop import stop_node_servers

    stop_node_servers(settings.PORTAL_LOCAL_NODE, reason="the local agent exited")
