"""Sending work to a node's agent: one function; the sender says how long its message is worth running.

Every task meant for a GPU node goes through `send_to_node`: by task *name* (so no sender imports
the tasks module, and no app imports one above it), to the node's own queue (`node.<name>`, which
only that node's agent consumes), and after the current transaction commits (the agent must find
the rows the request wrote; a rolled-back request sends nothing).

Expiry (docs/decisions.md, "One dispatcher for node work" and "Expiry comes from the sender"): a
message expires only when something sends it again, and only the sender knows whether something
does, so it passes `expires_s`. Periodic work (heartbeats, GPU samples here; supervision passes in
portal/deployments/dispatch.py) and commands that supervision re-derives from the desired state
expire; one-shot requests that nothing re-sends (discovery, software probe, hashing, conversion,
acceptance) pass nothing and never expire: their rows show them queued, each is safe to run late,
and an agent that was down finds them when it comes back. This module names no other app's tasks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from celery import uuid
from django.db import transaction

from portal.celery import CONTROL_QUEUE, app

if TYPE_CHECKING:
    from .models import Node


def send_to_node(
    node: Node,
    task_name: str,
    *,
    args: tuple | list = (),
    kwargs: dict[str, Any] | None = None,
    countdown: float = 0,
    expires_s: float | None = None,
) -> str:
    """Send `task_name` to `node`'s agent once the current transaction commits; returns the task id.

    Outside a transaction (a task, a command in autocommit) it is sent at once. The message expires
    `expires_s` after it is due (after `countdown`); None: never.
    """
    return _send_after_commit(
        node.queue, task_name, args=args, kwargs=kwargs, countdown=countdown, expires=expires_s
    )


def send_to_control(
    task_name: str,
    *,
    args: tuple | list = (),
    kwargs: dict[str, Any] | None = None,
    expires_s: float | None = None,
) -> str:
    """The same for work on the `control` worker (plain HTTP checks, fan-outs): no node involved."""
    return _send_after_commit(
        CONTROL_QUEUE, task_name, args=args, kwargs=kwargs, countdown=0, expires=expires_s
    )


def _send_after_commit(
    queue: str,
    task_name: str,
    *,
    args: tuple | list,
    kwargs: dict[str, Any] | None,
    countdown: float,
    expires: float | None,
) -> str:
    task_id = uuid()  # known now, so a request can answer with it before the message leaves
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
        transaction.on_commit(lambda: task.apply(args=tuple(args), kwargs=kwargs, task_id=task_id))
    else:
        transaction.on_commit(lambda: app.send_task(task_name, args=args, kwargs=kwargs, **options))
    return task_id
