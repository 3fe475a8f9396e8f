"""A node agent killed in the middle of a start: the next supervision pass cleans up and starts again.

A real Celery worker runs the start against the stand-in engine (see conftest.py),
slowed down so the kill lands while it waits for /health.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
from django.db import connection

from inference import supervisor
from portal.core.redis.client import redis_keys
from portal.deployments.agent.start import deployment_start
from portal.deployments.agent.supervise import deployment_supervise
from portal.deployments.models import Deployment
from portal.deployments.tasks import start_deployment
from tests.helpers.builders import make_deployment
from tests.helpers.deployments import FAKE_ENGINE

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.django_db(transaction=True)]


@pytest.mark.slow  # out of make test-fast: seconds of work on 2 cores
@pytest.mark.postgres(reason="an agent process shares the test database")
def test_it_recovers_when_the_agent_dies_during_a_start(
    team, tiny_version, tiny_profile, fake_node, reap_servers, run_dir, settings, tmp_path, monkeypatch
):
    settings.DEPLOYMENT_LEASE_TTL_S = 3
    queue = fake_node.queue
    redis.Redis.from_url(settings.CELERY_BROKER_URL).delete(redis_keys().celery_key(queue))
    db = connection.settings_dict
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "DATABASE_URL": f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}",
        "PORTAL_RUN_DIR": str(run_dir),
        "PYTHONPATH": str(FAKE_ENGINE),
        "FAKE_VLLM_STARTUP_S": "60",
        "DEPLOYMENT_LEASE_TTL_S": "3",
    }
    with open(tmp_path / "agent.log", "wb") as log:
        agent = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "portal", "worker", "-Q", queue, "--pool", "solo"],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deployment = make_deployment(team, tiny_version, tiny_profile, fake_node, desired_state="stopped")
        Deployment.objects.filter(pk=deployment.pk).update(desired_state="running", state="pending")
        start_deployment.apply_async(args=[deployment.pk], queue=queue)
        deadline = time.monotonic() + 60
        while not Deployment.objects.get(pk=deployment.pk).pgid:
            assert time.monotonic() < deadline, (tmp_path / "agent.log").read_text()[-3000:]
            time.sleep(0.2)
        os.killpg(agent.pid, signal.SIGKILL)  # the agent, not the server (its own session)
        agent.wait(timeout=10)
    finally:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
    deployment = Deployment.objects.get(pk=deployment.pk)
    orphan = deployment.pgid
    assert deployment.state == "starting" and supervisor.group_alive(orphan)

    time.sleep(3.5)  # the dead agent's lease expires
    assert deployment_supervise(deployment.pk, owner="beat") == "restart scheduled"
    deployment.refresh_from_db()
    assert not supervisor.group_alive(orphan)  # no second server next to the new one
    assert deployment.state == "pending" and "interrupted while starting" in deployment.state_reason
    monkeypatch.setenv("FAKE_VLLM_STARTUP_S", "0.3")
    assert deployment_start(deployment.pk, owner="new-agent") == "serving"
