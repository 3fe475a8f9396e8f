"""send_to_node: by name, to the node's queue, after commit, with the expiry its sender gives
(deployments' own in portal/deployments/dispatch.py).

The messages are read back from the real broker (Redis), as an agent would receive them.
"""

from __future__ import annotations

import datetime as dt

import pytest
from django.db import transaction

from portal.celery import app
from portal.deployments import dispatch as deployments_dispatch
from portal.deployments.dispatch import COMMAND_EXPIRES_S
from portal.inventory.dispatch import send_to_node
from portal.inventory.services import node_create

pytestmark = pytest.mark.django_db


@pytest.fixture
def node():
    node = node_create(name="dispatch-test")
    with app.connection_for_read() as connection:
        connection.SimpleQueue(node.queue).clear()  # a leftover of an earlier run
    return node


def received(queue: str) -> list[dict]:
    """The messages waiting on `queue` (taken off it), as their headers."""
    out = []
    with app.connection_for_read() as connection:
        messages = connection.SimpleQueue(queue)
        while True:
            try:
                message = messages.get(block=True, timeout=1)
            except messages.Empty:
                return out
            message.ack()
            out.append(message.headers)


def test_it_sends_by_name_to_the_nodes_queue_after_commit(node, django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=True):
        task_id = send_to_node(node, "inventory.discover_gpus", args=[node.name])
        assert received(node.queue) == []  # not before the request commits
    [headers] = received(node.queue)
    assert headers["task"] == "inventory.discover_gpus" and headers["id"] == task_id
    assert headers["expires"] is None  # a one-shot request nothing re-sends never expires


def test_a_rolled_back_request_sends_nothing(node, django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=True), pytest.raises(RuntimeError), transaction.atomic():
        send_to_node(node, "registry.hash_model_version", args=[1])
        raise RuntimeError("the request failed")
    assert received(node.queue) == []


def test_supervision_expires_after_two_intervals_and_commands_after_their_countdown(
    node, settings, django_capture_on_commit_callbacks
):
    settings.DEPLOYMENT_SUPERVISE_INTERVAL_S = 15
    before = dt.datetime.now(dt.UTC)
    send = deployments_dispatch.send_to_node
    with django_capture_on_commit_callbacks(execute=True):
        send(node, "deployments.supervise_node", args=[node.name])
        send(node, "deployments.start", args=[1], kwargs={"reason": "test"}, countdown=40)
    supervise, start = received(node.queue)
    after = dt.datetime.now(dt.UTC)

    def seconds(stamp: str) -> tuple[float, float]:
        at = dt.datetime.fromisoformat(stamp)
        return (at - after).total_seconds(), (at - before).total_seconds()

    low, high = seconds(supervise["expires"])
    assert low <= 30 <= high
    low, high = seconds(start["expires"])
    assert low <= 40 + COMMAND_EXPIRES_S <= high
    assert start["eta"] is not None


def test_in_eager_mode_it_runs_the_task_inline_after_commit(
    node, django_capture_on_commit_callbacks, monkeypatch
):
    """The benchmarks' throwaway worlds run with task_always_eager, which send_task alone ignores."""
    from portal.deployments.models import Deployment

    monkeypatch.setitem(app.conf, "task_always_eager", True)
    with django_capture_on_commit_callbacks(execute=True):
        send_to_node(node, "deployments.supervise_node", args=[node.name])
    assert received(node.queue) == []  # nothing went to the broker: it ran here
    assert not Deployment.objects.filter(node=node).exists()  # (and found nothing to supervise)


def test_a_sick_gpu_is_announced_and_deployments_sends_its_drain(node, django_capture_on_commit_callbacks):
    """inventory names no deployments task: its `gpus_sick` signal is answered by deployments, which
    sends the drain to `control` (a one-shot: it never expires)."""
    from portal.celery import CONTROL_QUEUE
    from portal.inventory.models import Node
    from portal.inventory.signals import gpus_sick

    with app.connection_for_read() as connection:
        connection.SimpleQueue(CONTROL_QUEUE).clear()
    with django_capture_on_commit_callbacks(execute=True):
        gpus_sick.send(sender=Node, node=node)
    [headers] = received(CONTROL_QUEUE)
    assert headers["task"] == "deployments.drain_sick_gpus" and headers["expires"] is None
    assert headers["argsrepr"] == repr([node.name])


def test_deployments_sends_only_its_own_tasks_with_its_expiry():
    with pytest.raises(ValueError):
        deployments_dispatch.expires_s("inventory.discover_gpus")
