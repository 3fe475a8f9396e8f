"""The agent bounds each engine's server.log: rotated by supervision, N old copies kept."""

from __future__ import annotations

from pathlib import Path

import pytest

from portal.deployments.agent.start import deployment_start
from portal.deployments.agent.stop import deployment_stop
from portal.deployments.agent.supervise import deployment_supervise
from portal.deployments.models import Deployment
from tests.helpers.builders import make_deployment

pytestmark = pytest.mark.django_db


@pytest.fixture
def deployment(team, tiny_version, tiny_profile, fake_node, reap_servers, settings):
    settings.ENGINE_LOG_MAX_BYTES = 4096
    settings.ENGINE_LOG_KEEP = 2
    return make_deployment(team, tiny_version, tiny_profile, fake_node)


def test_it_rotates_a_serving_engines_log_past_the_limit_on_a_supervision_tick(deployment):
    assert deployment_start(deployment.pk, owner="agent") == "serving"
    deployment.refresh_from_db()
    log = Path(deployment.log_path)
    with open(log, "a") as grow:  # what a chatty engine writes between two ticks
        grow.write("INFO request done\n" * 1000)
    assert deployment_supervise(deployment.pk, owner="beat") == "healthy"
    assert log.stat().st_size < 4096
    assert "INFO fake vLLM" in (log.parent / "server.log.1").read_text()
    assert deployment.events.filter(step="log", message__contains="rotated").exists()
    # Under the limit: nothing happens on the next tick.
    assert deployment_supervise(deployment.pk, owner="beat") == "healthy"
    assert not (log.parent / "server.log.2").exists()


def test_it_keeps_only_the_configured_number_of_old_logs_across_restarts(deployment):
    for _ in range(4):
        assert deployment_start(deployment.pk, owner="agent") == "serving"
        Deployment.objects.filter(pk=deployment.pk).update(desired_state="stopped")
        assert deployment_stop(deployment.pk, owner="agent") == "stopped"
        Deployment.objects.filter(pk=deployment.pk).update(desired_state="running", state="pending")
    run_dir = Path(Deployment.objects.get(pk=deployment.pk).run_dir)
    kept = sorted(p.name for p in run_dir.glob("server.log*"))
    assert kept == ["server.log", "server.log.1", "server.log.2"]
