"""Every page renders for a signed-in user and shows the planner's verdicts."""

import base64

import pytest
from django.core.management import call_command

from portal.deployments.models import DeploymentProfile
from portal.inventory.models import Node

pytestmark = pytest.mark.django_db


@pytest.fixture
def demo(db):
    call_command("seed_demo")


@pytest.mark.parametrize(
    "url",
    [
        "/",
        "/nodes/",
        "/nodes/dgx-v100-01/",
        "/nodes/local/",
        "/models/",
        "/models/llama-3.1-70b-instruct-gptq-4bit/",
        "/profiles/",
        "/profiles/v100-7b-fp16-tp8/",
        "/deployments/",
        "/planner/",
        "/planner/?profile=v100-70b-gptq-tp8",
    ],
)
def test_it_renders_each_page_for_a_team_member(client, bob, demo, url):
    client.force_login(bob)
    assert client.get(url).status_code == 200


def test_it_sends_anonymous_visitors_to_log_in(client, demo):
    response = client.get("/profiles/")
    assert response.status_code == 302
    assert response["Location"].startswith("/accounts/login/")


def test_it_shows_why_the_planner_refuses_a_profile(client, bob, demo):
    client.force_login(bob)
    page = client.get("/profiles/example-bf16-on-v100/").content.decode()
    assert "Refused" in page
    assert "bf16_unsupported" in page


def test_it_plans_from_the_planner_form(client, bob, demo):
    client.force_login(bob)
    page = client.get(
        "/planner/",
        {
            "model": "llama-2-7b-chat-hf",
            "gpu": "v100-pcie-16gb",
            "gpus": 1,
            "dtype": "float16",
            "gpu_memory_utilization": 0.93,
            "max_num_seqs": 256,
            "block_size": 16,
            "max_model_len": 4096,
        },
    ).content.decode()
    assert "max_num_seqs_preemption" in page
    assert "eager_off_on_volta" in page


def test_it_shows_a_form_error_instead_of_a_crash_for_bad_planner_input(client, bob, demo):
    client.force_login(bob)
    response = client.get("/planner/", {"model": "llama-2-7b-chat-hf", "gpu": "v100-pcie-16gb", "gpus": -1})
    assert response.status_code == 200
    assert "errorlist" in response.content.decode()


def test_it_lets_staff_open_the_admin_for_every_model(client, alice, demo):
    alice.is_superuser = True
    alice.save()
    client.force_login(alice)
    node = Node.objects.get(name="dgx-v100-01")
    profile = DeploymentProfile.objects.get(name="v100-7b-fp16-tp8")
    for url in [
        "/admin/inventory/node/",
        f"/admin/inventory/node/{node.pk}/change/",
        "/admin/inventory/gpu/",
        "/admin/registry/modelversion/",
        "/admin/registry/modelversion/add/",
        "/admin/deployments/deploymentprofile/",
        f"/admin/deployments/deploymentprofile/{profile.pk}/change/",
        "/admin/deployments/deployment/add/",
        "/admin/teams/team/",
    ]:
        assert client.get(url).status_code == 200, url


def test_it_serves_the_openapi_schema(client, bob):
    client.force_login(bob)
    response = client.get("/api/schema/", {"format": "json"})
    assert response.status_code == 200
    paths = response.json()["paths"]
    assert "/api/v1/plan/" in paths
    assert "/api/v1/nodes/{name}/nvidia-smi/" in paths


def test_the_openapi_schema_needs_the_credentials_the_api_needs(client, bob):
    assert client.get("/api/schema/", {"format": "json"}).status_code == 403
    assert client.get("/api/v1/").status_code == 403
    basic = "Basic " + base64.b64encode(b"bob:bob-password").decode()
    assert client.get("/api/schema/", {"format": "json"}, HTTP_AUTHORIZATION=basic).status_code == 200


def _admin_add_deployment(client, **overrides):
    from portal.registry.models import ModelVersion
    from portal.teams.models import Team

    data = {
        "name": "prod-7b",
        "team": Team.objects.get(slug="platform").pk,
        "model_version": ModelVersion.objects.get(name="llama-2-7b-chat-hf").pk,
        "profile": DeploymentProfile.objects.get(name="v100-7b-fp16-tp8").pk,
        "node": Node.objects.get(name="dgx-v100-01").pk,
        "gpu_indices": "[0, 1, 2, 3, 4, 5, 6, 7]",
        "desired_state": "running",
        "concurrency_cap": "",
        "sla_p95_ttft_s": "3.0",  # the form's initial values, as a browser would send them
        "sla_p95_tpot_s": "0.2",
        "gpu_failure_policy": "move",
        **overrides,
    }
    return client.post("/admin/deployments/deployment/add/", data)


def test_it_creates_a_deployment_from_the_admin_through_the_service(client, alice, demo):
    from portal.deployments.models import Deployment

    alice.is_superuser = True
    alice.save()
    client.force_login(alice)
    response = _admin_add_deployment(client)
    assert response.status_code == 302, response.content.decode()[:2000]
    assert Deployment.objects.get(name="prod-7b").gpu_indices == list(range(8))


def test_it_refuses_a_concurrency_cap_of_zero_in_the_admin_form(client, alice, demo):
    from portal.deployments.models import Deployment

    alice.is_superuser = True
    alice.save()
    client.force_login(alice)
    response = _admin_add_deployment(client, concurrency_cap="0")
    assert response.status_code == 200
    assert "greater than or equal to 1" in response.content.decode()
    assert not Deployment.objects.filter(name="prod-7b").exists()


def test_it_shows_the_planner_refusal_in_the_admin_form(client, alice, demo):
    from portal.deployments.models import Deployment

    alice.is_superuser = True
    alice.save()
    client.force_login(alice)
    bf16 = DeploymentProfile.objects.get(name="example-bf16-on-v100")
    response = _admin_add_deployment(client, profile=bf16.pk, gpu_indices="[0]")
    assert response.status_code == 200
    assert "no bf16" in response.content.decode()
    assert not Deployment.objects.exists()
