"""After a node reboot the recorded pid/pgid may be a stranger's: the agent never signals it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from inference import supervisor
from portal.deployments.agent.start import deployment_start
from portal.deployments.agent.stop import deployment_stop
from portal.deployments.agent.supervise import deployment_supervise
from portal.deployments.models import Deployment
from tests.helpers.builders import make_deployment

pytestmark = pytest.mark.django_db


@pytest.fixture
def stranger():
    """An unrelated process leading its own group: what the recorded number is after a reboot."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    yield process
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(10)


@pytest.fixture
def deployment(team, tiny_version, tiny_profile, fake_node, reap_servers):
    return make_deployment(team, tiny_version, tiny_profile, fake_node)


def _recorded_before_a_reboot(deployment, stranger, state: str) -> None:
    """The row as a server launched before the reboot left it, its pid now the stranger's."""
    identity = supervisor.ProcessIdentity(
        boot_id="the-boot-before", start_ticks=12345, cmdline=("/opt/vllm/bin/python", "-m", "vllm")
    )
    Deployment.objects.filter(pk=deployment.pk).update(
        state=state, pid=stranger.pid, pgid=stranger.pid, process_identity=identity.to_dict(), port=1
    )


def test_it_stops_a_deployment_without_signalling_the_process_now_holding_its_pgid(deployment, stranger):
    _recorded_before_a_reboot(deployment, stranger, "serving")
    Deployment.objects.filter(pk=deployment.pk).update(desired_state="stopped")
    assert deployment_stop(deployment.pk, owner="agent") == "stopped"
    assert stranger.poll() is None  # alive: it was never ours
    deployment.refresh_from_db()
    assert deployment.state == "stopped" and deployment.pgid is None and deployment.process_identity == {}


def test_it_restarts_a_server_lost_in_a_reboot_without_killing_the_new_owner_of_its_pid(
    deployment, stranger, django_capture_on_commit_callbacks
):
    _recorded_before_a_reboot(deployment, stranger, "serving")
    with django_capture_on_commit_callbacks():
        assert deployment_supervise(deployment.pk, owner="beat") == "restart scheduled"
    assert stranger.poll() is None
    assert "is gone" in Deployment.objects.get(pk=deployment.pk).state_reason
    assert deployment_start(deployment.pk, owner="agent") == "serving"
    assert stranger.poll() is None
    deployment.refresh_from_db()
    assert deployment.pid != stranger.pid
    assert deployment.process_identity["boot_id"] == supervisor.boot_id()


def test_it_starts_over_a_stale_pgid_from_an_interrupted_start_without_signalling_it(deployment, stranger):
    _recorded_before_a_reboot(deployment, stranger, "pending")
    assert deployment_start(deployment.pk, owner="agent") == "serving"
    assert stranger.poll() is None
    assert not deployment.events.filter(step="cleanup").exists()
