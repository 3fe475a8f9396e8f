"""A real Celery worker consuming `node.<name>` runs discovery on its machine."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.db import connection

from devtools import stop
from portal.celery import app
from portal.inventory.dispatch import send_to_node
from portal.inventory.models import Node
from portal.inventory.services import node_create

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.django_db(transaction=True)]


@pytest.fixture
def agent():
    """A node agent for node `ci-agent` against the test database and the real Redis."""
    db = connection.settings_dict
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "DATABASE_URL": f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}",
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    }
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "portal",
            "worker",
            "-Q",
            "node.ci-agent",
            "-n",
            "ci-agent@%h",
            "--concurrency",
            "1",
            "--pool",
            "solo",
            "--loglevel",
            "WARNING",
        ],
        cwd=ROOT,
        env=env,
        start_new_session=True,
    )
    yield process
    stop(process, grace_s=30)


@pytest.mark.postgres(reason="an agent process shares the test database")
def test_it_runs_discovery_on_the_nodes_own_queue(agent, settings):
    node = node_create(name="ci-agent")
    # Sent by name through the one dispatcher (autocommit here: at once), run by the node's agent.
    task_id = send_to_node(node, "inventory.discover_gpus", args=[node.name])
    # This machine has no GPUs: the agent reports none, and says so by stamping the node.
    assert app.AsyncResult(task_id).get(timeout=60) == 0
    node = Node.objects.get(pk=node.pk)
    assert node.discovered_at is not None
    assert node.interconnect == "none"
