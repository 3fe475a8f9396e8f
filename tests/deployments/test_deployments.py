"""Deployments: a profile on real GPUs, refused with a reason when it cannot work."""

import pytest

from portal.core.errors import ApplicationError
from portal.deployments.models import Deployment, DesiredState
from portal.deployments.services import deployment_create, deployment_plan, profile_plan
from tests.helpers import builders
from tests.helpers.clients import api_client

pytestmark = pytest.mark.django_db


def _create(team, model, profile, node, gpus, **extra):
    return deployment_create(
        name=extra.pop("name", "d1"),
        team=team,
        model_version=model,
        profile=profile,
        node=node,
        gpu_indices=gpus,
        **extra,
    )


def test_it_places_a_tp8_profile_on_the_eight_nvlinked_gpus(team, llama7b, profile_tp8, dgx):
    deployment = _create(team, llama7b, profile_tp8, dgx, list(range(8)))
    plan = deployment_plan(deployment)
    assert plan.ok
    assert abs(plan.weights_gb_per_gpu - 1.685) < 0.05


def test_it_refuses_a_gpu_count_other_than_the_tp_size(team, llama7b, profile_tp8, dgx):
    with pytest.raises(ApplicationError, match="exactly that many GPUs") as error:
        _create(team, llama7b, profile_tp8, dgx, [0, 1])
    assert error.value.field == "gpu_indices"


def test_it_refuses_gpus_the_node_does_not_have(team, llama7b, profile_tp1, dgx):
    with pytest.raises(ApplicationError, match=r"no GPU \[9\]"):
        _create(team, llama7b, profile_tp1, dgx, [9])


def test_it_refuses_a_gpu_another_running_deployment_holds(team, llama7b, profile_tp1, dgx):
    _create(team, llama7b, profile_tp1, dgx, [3], name="first")
    with pytest.raises(ApplicationError, match=r"GPU 3 \(first\)"):
        _create(team, llama7b, profile_tp1, dgx, [3], name="second")


def test_it_lets_a_stopped_deployment_share_gpus(team, llama7b, profile_tp1, dgx):
    _create(team, llama7b, profile_tp1, dgx, [3], name="first")
    _create(team, llama7b, profile_tp1, dgx, [3], name="spare", desired_state=DesiredState.STOPPED)
    assert Deployment.objects.count() == 2


def test_it_refuses_a_team_over_its_gpu_quota(team, llama7b, profile_tp1, dgx):
    team.gpu_quota = 1
    team.save()
    _create(team, llama7b, profile_tp1, dgx, [0], name="first")
    with pytest.raises(ApplicationError, match="holds 1 of its 1 GPUs") as error:
        _create(team, llama7b, profile_tp1, dgx, [1], name="second")
    assert error.value.field == "team"


def test_it_refuses_bf16_on_v100_with_the_reason_and_saves_nothing(team, qwen_bf16, dgx):
    profile = builders.profile(
        name="bf16", model_version=qwen_bf16, dtype="bfloat16", enforce_eager=True, max_model_len=8192
    )
    with pytest.raises(ApplicationError) as error:
        _create(team, qwen_bf16, profile, dgx, [0])
    assert "float16" in error.value.message
    assert [f["code"] for f in error.value.extra["findings"] if f["level"] == "error"] == ["bf16_unsupported"]
    assert not Deployment.objects.exists()


def test_it_warns_about_a_tensor_parallel_pair_over_pcie(team, llama7b, pcie_box):
    profile = builders.profile(
        name="tp2",
        model_version=llama7b,
        tensor_parallel_size=2,
        enforce_eager=True,
        max_model_len=4096,
        max_num_seqs=32,
    )
    deployment = _create(team, llama7b, profile, pcie_box, [0, 1])
    # The node's own topology names the path (PIX here) instead of the catalog's "over PCIe".
    assert "tp_pair_without_nvlink" in {f.code for f in deployment_plan(deployment).findings}


def test_it_sees_nvlink_between_directly_linked_dgx_gpus(team, llama7b, dgx):
    profile = builders.profile(
        name="tp2",
        model_version=llama7b,
        tensor_parallel_size=2,
        enforce_eager=True,
        max_model_len=4096,
        max_num_seqs=32,
    )
    deployment = _create(team, llama7b, profile, dgx, [0, 1])
    codes = {f.code for f in deployment_plan(deployment).findings}
    assert not codes & {"tp_over_pcie", "tp_pair_without_nvlink"}


def test_it_runs_a_deployment_on_a_cpu_node_without_a_gpu_plan(team, llama7b, profile_tp1, cpu_node):
    deployment = _create(team, llama7b, profile_tp1, cpu_node, [])
    assert deployment_plan(deployment) is None


def test_it_plans_a_profile_against_its_own_target(profile_tp8):
    plan = profile_plan(profile_tp8)
    assert plan.ok
    assert plan.kv_cache_tokens > 100_000


def test_it_has_no_plan_for_a_profile_without_a_target(db):
    assert profile_plan(builders.profile(name="bare")) is None


def test_it_hides_other_teams_deployments_from_members(team, llama7b, profile_tp1, dgx, charlie, bob):
    _create(team, llama7b, profile_tp1, dgx, [0])
    assert api_client(bob).get("/api/v1/deployments/d1/").status_code == 200
    assert api_client(charlie).get("/api/v1/deployments/d1/").status_code == 404
    assert api_client(charlie).get("/api/v1/deployments/").json()["count"] == 0


def test_it_creates_through_the_api_and_returns_the_plan(alice, team, llama7b, profile_tp8, dgx):
    response = api_client(alice).post(
        "/api/v1/deployments/",
        {
            "name": "prod",
            "team": "search",
            "model_version": llama7b.name,
            "profile": profile_tp8.name,
            "node": "dgx-v100-01",
            "gpu_indices": list(range(8)),
        },
        format="json",
    )
    assert response.status_code == 201, response.json()
    assert response.json()["plan"]["ok"] is True
    assert response.json()["state"] == "pending"


def test_it_answers_400_with_findings_when_the_planner_refuses(alice, team, qwen_bf16, dgx):
    builders.profile(name="bf16", dtype="bfloat16", max_model_len=8192, enforce_eager=True)
    response = api_client(alice).post(
        "/api/v1/deployments/",
        {
            "name": "bad",
            "team": "search",
            "model_version": qwen_bf16.name,
            "profile": "bf16",
            "node": "dgx-v100-01",
            "gpu_indices": [0],
        },
        format="json",
    )
    assert response.status_code == 400
    body = response.json()
    assert "profile" in body
    assert any(f["code"] == "bf16_unsupported" for f in body["findings"])


def test_it_refuses_deployment_writes_from_team_members(bob, team, llama7b, profile_tp1, dgx):
    response = api_client(bob).post(
        "/api/v1/deployments/",
        {
            "name": "mine",
            "team": "search",
            "model_version": llama7b.name,
            "profile": profile_tp1.name,
            "node": "dgx-v100-01",
            "gpu_indices": [0],
        },
        format="json",
    )
    assert response.status_code == 403


def test_it_plans_on_a_hand_entered_gpu_the_catalog_lacks(team, llama7b, profile_tp1, cpu_node):
    from portal.inventory.models import Gpu

    Gpu.objects.create(
        node=cpu_node,
        index=0,
        name="Prototype X",
        memory_mib=49152,
        compute_capability="8.6",
        bandwidth_gb_s=1000,
        fp16_tflops=150,
    )
    deployment = _create(team, llama7b, profile_tp1, cpu_node, [0])
    plan = deployment_plan(deployment)
    assert plan.ok
    assert plan.decode_tokens_per_s_ceiling == pytest.approx(
        1000e9 / (plan.weights_gb_per_gpu * 1e9), rel=0.01
    )


def test_it_counts_a_deployments_gpus_and_leaves_samples_without_a_gpu_count(team, llama7b, profile_tp8, dgx):
    from portal.deployments.models import MetricsSample

    deployment = _create(team, llama7b, profile_tp8, dgx, list(range(8)))
    assert deployment.gpu_count == 8
    sample = MetricsSample.objects.create(deployment=deployment, healthy=True)
    # A sample has no GPUs of its own: the count is the deployment's.
    assert not hasattr(sample, "gpu_count")


def test_it_refuses_a_cap_of_zero_in_the_model_and_the_api(alice, team, llama7b, profile_tp8, dgx):
    from django.core.exceptions import ValidationError

    deployment = Deployment(
        name="zero", team=team, model_version=llama7b, profile=profile_tp8, node=dgx, concurrency_cap=0
    )
    with pytest.raises(ValidationError) as refused:
        deployment.full_clean()
    assert "concurrency_cap" in refused.value.message_dict
    response = api_client(alice).post(
        "/api/v1/deployments/",
        {
            "name": "zero",
            "team": "search",
            "model_version": llama7b.name,
            "profile": profile_tp8.name,
            "node": "dgx-v100-01",
            "gpu_indices": list(range(8)),
            "concurrency_cap": 0,
        },
        format="json",
    )
    assert response.status_code == 400
    assert "concurrency_cap" in response.json()
    assert not Deployment.objects.filter(name="zero").exists()


def test_it_keeps_a_cap_of_zero_out_of_the_database(team, llama7b, profile_tp1, cpu_node):
    from django.db import IntegrityError, transaction

    deployment = _create(team, llama7b, profile_tp1, cpu_node, [], concurrency_cap=4)
    with pytest.raises(IntegrityError), transaction.atomic():
        Deployment.objects.filter(pk=deployment.pk).update(concurrency_cap=0)
