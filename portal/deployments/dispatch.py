"""Sending deployments' tasks: portal.inventory.dispatch carries them, this module says how long each
stays worth running (docs/decisions.md, "One dispatcher for node work", "Expiry comes from the sender").

A message expires only when something sends it again. Supervision passes (and the checks of adopted
servers) are re-sent every tick, so one that waited longer than two intervals is replaced by the
next. Commands (start, stop, restart, move) are re-derived by supervision from the desired state; a
stale one would act on an old intent. The drain of sick GPUs never expires: it decides once per
sickness, and a late one still finds the GPU sick (or finds nothing to do).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django.conf import settings

from portal.inventory import dispatch

if TYPE_CHECKING:
    from portal.inventory.models import Node

# How long a deployment command stays worth doing after it is due.
COMMAND_EXPIRES_S = 600
COMMANDS = frozenset({"deployments.start", "deployments.stop", "deployments.restart", "deployments.move"})
PERIODIC = frozenset({"deployments.supervise_node", "deployments.check_adopted"})


def expires_s(task_name: str) -> float | None:
    """Seconds a message of `task_name` stays valid once due; None: it never expires."""
    if task_name in PERIODIC:
        return 2 * settings.DEPLOYMENT_SUPERVISE_INTERVAL_S
    if task_name in COMMANDS:
        return COMMAND_EXPIRES_S
    if task_name == "deployments.drain_sick_gpus":
        return None
    raise ValueError(f"{task_name} is not a deployments task sent to a worker")


def send_to_node(
    node: Node,
    task_name: str,
    *,
    args: tuple | list = (),
    kwargs: dict[str, Any] | None = None,
    countdown: float = 0,
) -> str:
    """`portal.inventory.dispatch.send_to_node` with the task's expiry; returns the task id."""
    return dispatch.send_to_node(
        node, task_name, args=args, kwargs=kwargs, countdown=countdown, expires_s=expires_s(task_name)
    )


def send_to_control(task_name: str, *, args: tuple | list = (), kwargs: dict[str, Any] | None = None) -> str:
    """`portal.inventory.dispatch.send_to_control` with the task's expiry; returns the task id."""
    return dispatch.send_to_control(task_name, args=args, kwargs=kwargs, expires_s=expires_s(task_name))
