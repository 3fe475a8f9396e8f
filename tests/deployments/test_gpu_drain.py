"""Work drained off a sick GPU: a serving simulator deployment moved through the real lifecycle
(drain, stop, start on healthy GPUs), or kept and flagged, each decision on its timeline and in the
audit log (portal/deployments/gpu_drain.py)."""

from __future__ import annotations

import pytest
from django.utils import timezone

from inference import supervisor
from inference.gpu_health import Sample, parse_health_csv
from portal.audit.models import AuditEvent
from portal.deployments.agent.move import deployment_move
from portal.deployments.agent.start import deployment_start
from portal.deployments.gpu_drain import move_target, node_drain_sick_gpus
from portal.deployments.services import deployment_plan
from portal.inventory.services import node_apply_nvidia_smi_text, node_create, node_record_gpu_health
from portal.registry.services import model_version_create
from tests.helpers import builders
from tests.helpers.builders import make_deployment
from tests.helpers.real_gpu import real_gpu_output
from tests.helpers.samples import bundled_config, nvidia_smi_sample

pytestmark = pytest.mark.django_db


def _health(node, fixture: str) -> None:
    sample = Sample(at=timezone.now(), gpus=tuple(parse_health_csv(nvidia_smi_sample(fixture))))
    node_record_gpu_health(node=node, sample=sample)


@pytest.fixture
def sim_on_gpu3(team, dgx, run_dir, reap_servers):
    version = model_version_create(name="llama-2-7b-chat-hf", config=bundled_config("llama-2-7b-chat-hf"))
    profile = builders.profile(
        name="sim-7b", engine="sim", max_model_len=4096, gpu_memory_utilization=0.93, enforce_eager=True
    )
    _health(dgx, "health_v100_sxm2_8x_healthy.csv")
    deployment = make_deployment(team, version, profile, dgx, name="chat", gpus=[3])
    assert deployment_start(deployment.pk, owner="test-agent") == "serving"
    deployment.refresh_from_db()
    return deployment


def test_it_moves_a_serving_deployment_off_a_degraded_gpu_through_the_lifecycle(sim_on_gpu3, dgx):
    deployment = sim_on_gpu3
    old_pgid = deployment.pgid
    _health(dgx, "health_v100_sxm2_8x_ecc_uncorrectable.csv")
    (decision,) = node_drain_sick_gpus(node=dgx)
    assert (decision.action, decision.target_node, decision.target_gpus) == ("move", dgx.name, (0,))
    assert "GPU 3 is degraded" in decision.message and "uncorrectable ECC" in decision.message
    # A second sample while the move is under way decides nothing new.
    assert node_drain_sick_gpus(node=dgx)[0].action == "already decided"

    result = deployment_move(deployment.pk, owner="test-agent", node_id=dgx.pk, gpu_indices=[0], reason="ECC")
    assert result == "moved"
    deployment.refresh_from_db()
    assert (deployment.gpu_indices, deployment.state) == ([0], "pending")
    assert not supervisor.group_alive(old_pgid)
    assert deployment_start(deployment.pk, owner="test-agent") == "serving"
    deployment.refresh_from_db()
    assert deployment.state == "serving" and deployment.gpu_indices == [0]

    steps = [(e.step, e.status) for e in deployment.events.all()]
    move_at = steps.index(("gpu-health", "info"))
    assert steps[move_at:].index(("drain", "ok")) < steps[move_at:].index(("stop", "ok"))
    assert ("gpu-health", "ok") in steps[move_at:] and steps[-1][0] == "serving"
    audit = AuditEvent.objects.get(action="deployment.gpu_move")
    assert audit.changes["gpu_indices"] == [[3], [0]]


def test_it_keeps_and_flags_a_deployment_whose_policy_is_keep(sim_on_gpu3, dgx):
    deployment = sim_on_gpu3
    deployment.gpu_failure_policy = "keep"
    deployment.save(update_fields=["gpu_failure_policy"])
    _health(dgx, "health_v100_sxm2_8x_ecc_uncorrectable.csv")
    (decision,) = node_drain_sick_gpus(node=dgx)
    assert decision.action == "keep" and "policy is keep" in decision.message
    assert node_drain_sick_gpus(node=dgx)[0].action == "already decided"
    event = deployment.events.filter(step="gpu-health").get()
    assert event.status == "skipped" and "Move or stop it by hand" in event.message
    assert AuditEvent.objects.filter(action="deployment.gpu_keep").count() == 1
    deployment.refresh_from_db()
    assert deployment.state == "serving" and deployment.gpu_indices == [3]


def test_it_keeps_and_flags_a_deployment_with_nowhere_to_go(sim_on_gpu3, dgx):
    dgx.gpus.exclude(index=3).update(health_state="lost")
    _health(dgx, "health_v100_sxm2_8x_ecc_uncorrectable.csv")
    dgx.gpus.exclude(index=3).update(health_state="lost")  # the sample said healthy; say lost again
    (decision,) = node_drain_sick_gpus(node=dgx)
    assert decision.action == "keep" and "no free healthy GPUs of its kind" in decision.message


def test_it_moves_to_another_node_when_its_own_has_no_room(sim_on_gpu3, dgx):
    spare = node_create(name="dgx-v100-02")
    node_apply_nvidia_smi_text(
        node=spare,
        query_csv=nvidia_smi_sample("v100_sxm2_8x_query.csv"),
        topology_text=nvidia_smi_sample("v100_sxm2_8x_topo.txt"),
    )
    _health(dgx, "health_v100_sxm2_8x_ecc_uncorrectable.csv")
    dgx.gpus.exclude(index=3).update(health_state="degraded")
    assert move_target(sim_on_gpu3) == (spare, [0])


def test_it_does_not_move_a_deployment_stopped_meanwhile(sim_on_gpu3, dgx):
    from portal.deployments.services import deployment_request_stop

    deployment_request_stop(deployment=sim_on_gpu3)
    moved = deployment_move(sim_on_gpu3.pk, owner="t", node_id=dgx.pk, gpu_indices=[0], reason="x")
    assert moved == "not running"


def test_a_move_whose_command_expired_unrun_is_decided_again(sim_on_gpu3, dgx):
    import datetime as dt

    from portal.deployments.dispatch import COMMAND_EXPIRES_S
    from portal.deployments.models import DeploymentEvent
    from portal.deployments.tasks import drain_sick_gpus

    _health(dgx, "health_v100_sxm2_8x_ecc_uncorrectable.csv")
    assert drain_sick_gpus(dgx.name) == ["chat: move"]
    assert drain_sick_gpus(dgx.name) == ["chat: already decided"]
    long_ago = timezone.now() - dt.timedelta(seconds=COMMAND_EXPIRES_S + 1)
    DeploymentEvent.objects.filter(step="gpu-health").update(at=long_ago)
    dgx.gpus.filter(index=3).update(health_since=long_ago - dt.timedelta(seconds=1))
    assert drain_sick_gpus(dgx.name) == ["chat: move"]
    assert drain_sick_gpus("no-such-node") == []


def test_the_api_takes_a_failure_policy_on_create_and_refuses_an_unknown_one(
    alice, team, llama7b, profile_tp1, dgx
):
    from tests.helpers.clients import api_client

    body = {"team": "search", "model_version": llama7b.name, "profile": profile_tp1.name, "node": dgx.name}
    created = api_client(alice).post(
        "/api/v1/deployments/", {**body, "name": "pinned", "gpu_indices": [1], "gpu_failure_policy": "keep"},
        format="json",
    )  # fmt: skip
    assert created.status_code == 201, created.json()
    assert created.json()["gpu_failure_policy"] == "keep"
    refused = api_client(alice).post(
        "/api/v1/deployments/", {**body, "name": "odd", "gpu_indices": [2], "gpu_failure_policy": "pray"},
        format="json",
    )  # fmt: skip
    assert refused.status_code == 400 and "gpu_failure_policy" in refused.json()
    plain = {**body, "name": "d", "gpu_indices": [2]}
    default = api_client(alice).post("/api/v1/deployments/", plain, format="json")
    assert default.json()["gpu_failure_policy"] == "move"


def test_it_prefers_healthy_gpus_to_warning_ones(sim_on_gpu3, dgx):
    _health(dgx, "health_v100_sxm2_8x_ecc_uncorrectable.csv")
    dgx.gpus.filter(index__in=[0, 1]).update(health_state="warning")
    assert move_target(sim_on_gpu3) == (dgx, [2])


def _dgx1_node(name: str):
    node = node_create(name=name)
    node_apply_nvidia_smi_text(
        node=node,
        query_csv=nvidia_smi_sample("v100_sxm2_8x_query.csv"),
        topology_text=real_gpu_output("topo-dgx1-v100-sxm2-8x-microway.txt"),
    )
    return node


def test_it_moves_a_tp4_group_onto_gpus_that_keep_its_nvlink_ring(team, llama7b):
    first, second = _dgx1_node("dgx-a"), _dgx1_node("dgx-b")
    profile = builders.profile(
        llama7b, name="tp4", tensor_parallel_size=4, max_model_len=4096, enforce_eager=True
    )
    deployment = make_deployment(
        team, llama7b, profile, first, name="tp4", desired_state="stopped", gpus=[0, 1, 2, 3]
    )
    # dgx-a keeps too few healthy GPUs; on dgx-b GPU 0 is sick, so {1,2,3,x} cannot be a ring.
    first.gpus.filter(index__in=[0, 4]).update(health_state="degraded")
    second.gpus.filter(index=0).update(health_state="degraded")

    assert move_target(deployment) == (second, [4, 5, 6, 7])


def test_it_warns_a_tp4_deployment_on_0124_of_a_dgx1(team, llama7b):
    node = _dgx1_node("dgx-a")
    profile = builders.profile(
        llama7b, name="tp4", tensor_parallel_size=4, max_model_len=4096, enforce_eager=True
    )
    deployment = make_deployment(
        team, llama7b, profile, node, name="tp4", desired_state="stopped", gpus=[0, 1, 2, 4]
    )

    findings = {f.code: f.level for f in deployment_plan(deployment).findings}

    assert findings["tp_no_nvlink_ring"] == "warning"
