"""Sending work to a node's agent: one function, one expiry policy.

Every task meant for a GPU node goes through `send_to_node`: by task *name* (so no sender imports
the tasks module, and no app imports one above it), to the node's own queue (`node.<name>`, which
only that node's agent consumes), and after the current transaction commits (the agent must find
the rows the request wrote; a rolled-back request sends nothing).

Expiry (docs/decisions.md, "One dispatcher for node work"): a message expires only when something
sends it again. Supervision passes are re-sent every tick; deployment commands (start, stop,
restart) are re-derived by supervision from the desired state. A stale one would act on an old
intent, so both expire. One-shot requests that nothing re-sends (discovery, software probe,
hashing, conversion, acceptance) never expire: their rows show them queued, each is safe to run
late, and an agent that was down finds them when it comes back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from celery import uuid
from django.conf import settings
from django.db import transaction

from portal.celery import CONTROL_QUEUE, app

if TYPE_CHECKING:
    from .models import Node

# How long a deployment command stays worth doing after it is due.
DEPLOYMENT_COMMAND_EXPIRES_S = 600


def expires_after_s(task_name: str) -> float | None:
    """Seconds a message of `task_name` stays valid once due; None: it never expires."""
    interval = settings.DEPLOYMENT_SUPERVISE_INTERVAL_S
    policy: dict[str, float] = {
        # Periodic: the next tick replaces a pass that waited longer than two intervals.
        "deployments.supervise_node": 2 * interval,
        "deployments.check_adopted": 2 * interval,
        # A heartbeat answered late would say a dead agent is alive: it lives one interval.
        "inventory.agent_heartbeat": settings.NODE_HEARTBEAT_INTERVAL_S,
        "inventory.sample_gpu_health": 2 * settings.GPU_HEALTH_SAMPLE_INTERVAL_S,
        "deployments.move": DEPLOYMENT_COMMAND_EXPIRES_S,
        # Commands: supervision reconciles from the desired state if one is lost.
        "deployments.start": DEPLOYMENT_COMMAND_EXPIRES_S,
        "deployments.stop": DEPLOYMENT_COMMAND_EXPIRES_S,
        "deployments.restart": DEPLOYMENT_COMMAND_EXPIRES_S,
    }
    return policy.get(task_name)


def send_to_node(
    node: Node,
    task_name: str,
    *,
    args: tuple | list = (),
    kwargs: dict[str, Any] | None = None,
    countdown: float = 0,
) -> str:
    """Send `task_name` to `node`'s agent once the current transaction commits; returns the task id.

    Outside a transaction (a task, a command in autocommit) it is sent at once.
    """
    return _send_after_commit(node.queue, task_name, args=args, kwargs=kwargs, countdown=countdown)


def send_to_control(
    task_name: str, *, args: tuple | list = (), kwargs: dict[str, Any] | None = None
) -> str:
    """The same for work on the `control` worker (plain HTTP checks, fan-outs): no node involved."""
    return _send_after_commit(CONTROL_QUEUE, task_name, args=args, kwargs=kwargs, countdown=0)


def _send_after_commit(
    queue: str, task_name: str, *, args: tuple | list, kwargs: dict[str, Any] | None, countdown: float
) -> str:
    task_id = uuid()  # known now, so a request can answer with it before the message leaves
    expires = expires_after_s(task_name)
    options: dict[str, Any] = {"queue": queue, "task_id": task_id}
    if countdown:
        options["countdown"] = countdown
    if expires is not None:
        options["expires"] = countdown + expires
    args, kwargs = list(args), dict(kwargs or {})
    if app.conf.task_always_eager:
        # send_task ignores eager mode; the benchmarks' throwaway worlds (and any single-process
        # setup) rely on it to run the task inline, as apply_async would.
        app.loader.import_default_modules()  # autodiscovery, which a worker would have done
        task = app.tasks[task_name]
        transaction.on_commit(lambda: task.apply(args=args, kwargs=kwargs, task_id=task_id))
    else:
        transaction.on_commit(lambda: app.send_task(task_name, args=args, kwargs=kwargs, **options))
    return task_id
