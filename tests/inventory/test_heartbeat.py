"""A node's agent answers a heartbeat; the node page, the node list and the dashboard say whether one
is listening, and a deployment left `pending` with nobody to pick it up says so on its timeline."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from devtools import wait_until
from portal.deployments.models import DeploymentEvent
from portal.inventory.models import AgentState, Node
from portal.inventory.services import node_create, node_record_heartbeat
from portal.inventory.tasks import heartbeat_all
from tests.helpers import builders
from tests.helpers.agents import node_agent

VERSIONS = {"portal": "0.1.0", "commit": "abc123def456", "python": "3.11.9", "celery": "5.5.3"}


@pytest.mark.django_db
def test_it_tells_listening_silent_and_never_seen_agents_apart(settings):
    settings.NODE_AGENT_SILENT_S = 45
    node = node_create(name="hb-node")
    assert node.agent.state == AgentState.NEVER
    node_record_heartbeat(node_name="hb-node", versions=VERSIONS)
    node.refresh_from_db()
    assert node.agent.state == AgentState.LISTENING and node.agent.versions["commit"] == "abc123def456"
    Node.objects.filter(pk=node.pk).update(agent_seen_at=timezone.now() - timedelta(seconds=46))
    node.refresh_from_db()
    assert node.agent.state == AgentState.SILENT


@pytest.mark.django_db
def test_the_node_page_list_and_dashboard_say_when_no_agent_listens(client, alice):
    node_create(name="hb-node")
    client.force_login(alice)
    page = client.get("/nodes/hb-node/").content.decode()
    assert "No agent is listening on <code>node.hb-node</code>" in page
    assert "celery -A portal worker -Q node.hb-node" in page
    assert "no agent seen" in client.get("/nodes/").content.decode()
    assert "no agent seen" in client.get("/").content.decode()

    node_record_heartbeat(node_name="hb-node", versions=VERSIONS)
    page = client.get("/nodes/hb-node/").content.decode()
    assert "No agent is listening" not in page and "agent listening" in page
    assert "abc123def456" in page and "3.11.9" in page
    dashboard = client.get("/").content.decode()
    assert "agent listening" in dashboard and "abc123de · Py 3.11.9" in dashboard


@pytest.mark.django_db
def test_a_pending_deployment_nobody_picked_up_says_so_on_its_timeline(client, alice, settings, team):
    from portal.registry.services import model_version_create
    from tests.helpers.samples import bundled_config

    settings.DEPLOYMENT_PENDING_WARN_S = 60
    node = node_create(name="hb-node")
    version = model_version_create(name="tiny", config=bundled_config("llama-2-7b-chat-hf"))
    profile = builders.profile(name="cpu", model_version=version, dtype="float32")
    deployment = builders.deployment(
        name="waits", team=team, model_version=version, profile=profile, node=node,
        desired_state="running", state="pending",
    )  # fmt: skip
    DeploymentEvent.objects.create(deployment=deployment, step="created", status="info", message="created")
    client.force_login(alice)
    assert "No agent has picked this up" not in client.get("/deployments/waits/").content.decode()

    DeploymentEvent.objects.filter(deployment=deployment).update(at=timezone.now() - timedelta(seconds=90))
    page = client.get("/deployments/waits/").content.decode()
    assert "No agent has picked this up for 90 s: no agent is listening on node hb-node" in page
    assert "has never answered" in page and "celery -A portal worker -Q node.hb-node" in page

    node_record_heartbeat(node_name="hb-node", versions=VERSIONS)  # an agent, busy with something long
    page = client.get("/deployments/waits/").content.decode()
    assert "though the agent of hb-node answered its heartbeat" in page


@pytest.mark.django_db(transaction=True)
@pytest.mark.postgres(reason="an agent process shares the test database")
def test_a_real_agent_answers_on_start_and_to_each_beat(tmp_path, settings):
    settings.PORTAL_RUN_DIR = str(tmp_path / "run")
    node = node_create(name="hb-agent")
    with node_agent("hb-agent", tmp_path / "agent.log"):
        # The agent answers once as it starts, before any beat tick.
        wait_until(lambda: Node.objects.get(pk=node.pk).agent_seen_at is not None, timeout_s=60, what="start")
        Node.objects.filter(pk=node.pk).update(agent_seen_at=None, agent_versions={})
        assert heartbeat_all() >= 1  # beat's fan-out, through the broker to the node's queue
        wait_until(
            lambda: Node.objects.get(pk=node.pk).agent_seen_at is not None, timeout_s=60, what="heartbeat"
        )
    node.refresh_from_db()
    assert node.agent.listening
    assert node.agent_versions["portal"] and node.agent_versions["python"].startswith("3.")


@pytest.mark.django_db
def test_a_node_without_an_agent_gets_one_heartbeat_waiting_not_one_per_tick(
    django_capture_on_commit_callbacks,
):
    import redis
    from django.conf import settings

    from portal.core.redis.client import redis_keys

    node = node_create(name="hb-lonely")
    broker = redis.Redis.from_url(settings.CELERY_BROKER_URL)
    key = redis_keys().celery_key(node.queue)
    broker.delete(key)

    def tick() -> None:
        with django_capture_on_commit_callbacks(execute=True):
            heartbeat_all()

    for _ in range(3):  # three beat ticks, no agent
        tick()
    assert broker.llen(key) == 1
    node_record_heartbeat(node_name="hb-lonely", versions=VERSIONS)  # an agent is back and listening
    tick()
    assert broker.llen(key) == 2
    broker.delete(key)
