"""The portal's "Create a deployment" page (staff), GPUs typed as ranges or ticked, the same checks
as the API; the admin's GPU field reads ranges too, and a team's allowed models are a multi-select."""

from __future__ import annotations

import pytest
from django import forms

from portal.deployments.forms import format_gpu_indices, parse_gpu_indices
from portal.deployments.models import Deployment

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize(
    ("text", "indices"),
    [("", []), ("0-3", [0, 1, 2, 3]), ("0,2", [0, 2]), ("0-1, 4 6-7", [0, 1, 4, 6, 7]), ("[0, 1]", [0, 1])],
)
def test_it_reads_gpu_ranges_and_lists(text, indices):
    assert parse_gpu_indices(text) == indices
    assert parse_gpu_indices(format_gpu_indices(indices)) == indices


@pytest.mark.parametrize(("text", "why"), [("0-x", "not a GPU index"), ("3-1", "low to high"),
                                           ("0-999999999", "from 0 to 63"), ("1,1", "twice")])  # fmt: skip
def test_it_refuses_what_is_not_a_gpu_list_with_a_clear_message(text, why):
    with pytest.raises(forms.ValidationError, match=why):
        parse_gpu_indices(text)


def _form(team, llama7b, profile, node, **overrides) -> dict:
    return {
        "name": "search-7b", "team": team.pk, "model_version": llama7b.pk, "profile": profile.pk,
        "node": node.pk, "gpu_indices": "0-7", "desired_state": "running", **overrides,
    }  # fmt: skip


def test_staff_create_a_running_deployment_from_a_range(client, alice, team, llama7b, profile_tp8, dgx):
    client.force_login(alice)
    page = client.get("/deployments/new/")
    assert page.status_code == 200 and page.context["form"]["desired_state"].value() == "running"
    response = client.post("/deployments/new/", _form(team, llama7b, profile_tp8, dgx))
    assert response.status_code == 302 and response["Location"] == "/deployments/search-7b/"
    deployment = Deployment.objects.get(name="search-7b")
    assert deployment.gpu_indices == list(range(8)) and deployment.desired_state == "running"
    assert deployment.state == "pending"


def test_ticked_gpus_count_like_typed_ones(client, alice, team, llama7b, profile_tp1, dgx):
    client.force_login(alice)
    response = client.post(
        "/deployments/new/", _form(team, llama7b, profile_tp1, dgx, gpu_indices="", gpu_boxes=["3"])
    )
    assert response.status_code == 302
    assert Deployment.objects.get(name="search-7b").gpu_indices == [3]


def test_a_refusal_is_shown_beside_the_gpus_and_nothing_is_saved(
    client, alice, team, llama7b, profile_tp8, dgx
):
    client.force_login(alice)
    response = client.post("/deployments/new/", _form(team, llama7b, profile_tp8, dgx, gpu_indices="0-3"))
    assert response.status_code == 400
    assert "tensor parallel size 8" in response.context["form"].errors["gpu_indices"][0]
    assert "Enter a valid JSON" not in response.content.decode()
    assert not Deployment.objects.exists()


def test_the_page_is_for_staff_only(client, bob, team, llama7b, profile_tp8, dgx):
    client.force_login(bob)
    assert client.get("/deployments/new/").status_code == 403
    assert client.post("/deployments/new/", _form(team, llama7b, profile_tp8, dgx)).status_code == 403
    assert not Deployment.objects.exists()


def test_a_node_page_links_the_form_with_the_node_picked(client, alice, dgx):
    client.force_login(alice)
    assert 'href="/deployments/new/?node=dgx-v100-01"' in client.get("/nodes/dgx-v100-01/").content.decode()
    form = client.get("/deployments/new/?node=dgx-v100-01").context["form"]
    assert form["node"].value() == dgx.pk


def test_the_deployment_list_links_the_portal_page(client, alice):
    client.force_login(alice)
    page = client.get("/deployments/").content.decode()
    assert 'href="/deployments/new/"' in page and "/admin/deployments/deployment/add/" not in page


def test_the_admin_reads_a_gpu_range_and_defaults_to_running(admin_client, team, llama7b, profile_tp8, dgx):
    page = admin_client.get("/admin/deployments/deployment/add/").content.decode()
    assert '<option value="running" selected>' in page
    data = {**_form(team, llama7b, profile_tp8, dgx), "concurrency_cap": "",
            "sla_p95_ttft_s": "3.0", "sla_p95_tpot_s": "0.2", "gpu_failure_policy": "move"}  # fmt: skip
    response = admin_client.post("/admin/deployments/deployment/add/", data)
    assert response.status_code == 302, response.context["adminform"].form.errors
    assert Deployment.objects.get(name="search-7b").gpu_indices == list(range(8))


def test_a_teams_allowed_models_are_picked_not_typed_as_json(admin_client, team, llama7b, qwen_bf16):
    page = admin_client.get(f"/admin/teams/team/{team.pk}/change/").content.decode()
    assert '<select name="allowed_models"' in page and 'value="qwen2.5-7b-instruct"' in page
    form = admin_client.get(f"/admin/teams/team/{team.pk}/change/").context["adminform"].form
    data = {k: v for k, v in form.initial.items() if v is not None and k != "members"}
    data.update(allowed_models=["llama-2-7b-chat-hf"], members=[m.pk for m in team.members.all()])
    response = admin_client.post(f"/admin/teams/team/{team.pk}/change/", data)
    assert response.status_code == 302, response.context["adminform"].form.errors
    team.refresh_from_db()
    assert team.allowed_models == ["llama-2-7b-chat-hf"]


def test_a_taken_name_is_refused_beside_the_name(client, alice, team, llama7b, profile_tp1, dgx):
    client.force_login(alice)
    client.post("/deployments/new/", _form(team, llama7b, profile_tp1, dgx, gpu_indices="0"))
    response = client.post("/deployments/new/", _form(team, llama7b, profile_tp1, dgx, gpu_indices="1"))
    assert response.status_code == 400
    assert "name" in response.context["form"].errors
    assert Deployment.objects.count() == 1
