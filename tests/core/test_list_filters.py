"""List filters (one FilterSet per model, portal/*/filters.py): the same filters on the REST API and
on the list pages, each value bounded (a bad one is a 400 naming the field, or a form error on the
page), and a filter never reaches rows the caller could not list without it."""

from __future__ import annotations

import pytest
from django.test import Client

from portal.benchmarks.models import BenchmarkRun
from tests.helpers import builders
from tests.helpers.clients import api_client

pytestmark = pytest.mark.django_db


@pytest.fixture
def ads(django_user_model):
    """Team "ads" with its member dave: bob (team "search") must never see its rows."""
    dave = django_user_model.objects.create_user("dave", password="dave-password")
    return builders.team(name="Ads", slug="ads", gpu_quota=8, members=[dave])


@pytest.fixture
def world(team, ads, dgx, llama7b, profile_tp1):
    ours = builders.deployment(
        name="search-llama", team=team, model_version=llama7b, profile=profile_tp1, node=dgx,
        gpu_indices=[0], desired_state="running", state="serving",
    )  # fmt: skip
    ours_stopped = builders.deployment(
        name="search-old", team=team, model_version=llama7b, profile=profile_tp1, node=dgx,
        gpu_indices=[1], state="stopped",
    )  # fmt: skip
    theirs = builders.deployment(
        name="ads-llama", team=ads, model_version=llama7b, profile=profile_tp1, node=dgx,
        gpu_indices=[2], desired_state="running", state="serving",
    )  # fmt: skip
    for deployment, state in ((ours, "done"), (ours_stopped, "failed"), (theirs, "done")):
        BenchmarkRun.objects.create(deployment=deployment, mix="short-qa", state=state, title=deployment.name)
    return ours, ours_stopped, theirs


def names(response) -> list[str]:
    assert response.status_code == 200, response.content
    return sorted(row.get("name") or row.get("title") for row in response.json()["results"])


# --- nodes and GPUs -------------------------------------------------------------------------------


def test_it_filters_nodes_by_name_and_gpu_kind(bob, dgx, pcie_box):
    client = api_client(bob)
    assert names(client.get("/api/v1/nodes/", {"name": "DGX"})) == ["dgx-v100-01"]
    assert names(client.get("/api/v1/nodes/", {"gpu": "v100-pcie-16gb"})) == ["pcie-v100-04"]


def test_it_refuses_a_node_filter_outside_its_choices_naming_the_field(bob, dgx):
    response = api_client(bob).get("/api/v1/nodes/", {"engine": "tensorrt"})
    assert response.status_code == 400
    assert "engine" in response.json()


def test_it_filters_gpus_by_node_and_index(bob, dgx, pcie_box):
    client = api_client(bob)
    rows = client.get("/api/v1/gpus/", {"node": "pcie-v100-04"}).json()["results"]
    assert len(rows) == 4
    assert [
        row["index"]
        for row in client.get("/api/v1/gpus/", {"node": "dgx-v100-01", "index": 3}).json()["results"]
    ] == [3]


@pytest.mark.parametrize("query", [{"index": "-1"}, {"index": "256"}, {"index": "two"}, {"node": "nope"}])
def test_it_refuses_a_gpu_filter_out_of_bounds(bob, dgx, query):
    response = api_client(bob).get("/api/v1/gpus/", query)
    assert response.status_code == 400
    assert set(response.json()) == set(query)


# --- model versions and profiles ------------------------------------------------------------------


def test_it_filters_model_versions_and_refuses_an_unknown_quantization(bob, llama7b, qwen_bf16):
    client = api_client(bob)
    assert names(client.get("/api/v1/model-versions/", {"weight_dtype": "bfloat16"})) == [qwen_bf16.name]
    assert client.get("/api/v1/model-versions/", {"quantization": "q4_k_m"}).status_code == 400
    assert client.get("/api/v1/model-versions/", {"name": "x" * 201}).status_code == 400


def test_it_filters_profiles_by_tensor_parallel_size_within_bounds(bob, profile_tp1, profile_tp8):
    client = api_client(bob)
    assert names(client.get("/api/v1/profiles/", {"tensor_parallel_size": 8})) == [profile_tp8.name]
    for bad in ("0", "65", "1.5"):
        response = client.get("/api/v1/profiles/", {"tensor_parallel_size": bad})
        assert response.status_code == 400 and "tensor_parallel_size" in response.json(), bad


# --- deployments, benchmark runs, teams: another team's rows never appear ------------------------


def test_it_filters_deployments_by_state_within_the_users_own(bob, world):
    client = api_client(bob)
    assert names(client.get("/api/v1/deployments/", {"state": "serving"})) == ["search-llama"]
    assert names(client.get("/api/v1/deployments/", {"name": "llama"})) == ["search-llama"]


def test_a_filter_naming_another_teams_deployment_or_team_finds_nothing_of_it(bob, world):
    client = api_client(bob)
    assert names(client.get("/api/v1/deployments/", {"name": "ads-llama"})) == []
    refused = client.get("/api/v1/deployments/", {"team": "ads"})
    assert refused.status_code == 400  # as for a team that does not exist: nothing said about "ads"
    assert refused.json() == client.get("/api/v1/deployments/", {"team": "no-such-team"}).json() | {
        "team": refused.json()["team"]
    }
    assert "ads-llama" not in refused.content.decode()


def test_staff_filter_deployments_by_any_team(alice, world):
    assert names(api_client(alice).get("/api/v1/deployments/", {"team": "ads"})) == ["ads-llama"]


def test_it_filters_benchmark_runs_and_never_shows_another_teams(bob, world):
    client = api_client(bob)
    assert names(client.get("/api/v1/benchmark-runs/", {"state": "done"})) == ["search-llama"]
    assert names(client.get("/api/v1/benchmark-runs/", {"deployment": "ads-llama"})) == []
    assert client.get("/api/v1/benchmark-runs/", {"state": "finished"}).status_code == 400
    assert client.get("/api/v1/benchmark-runs/", {"mix": "m" * 301}).status_code == 400


def test_it_filters_teams_and_never_shows_another_teams(bob, world):
    client = api_client(bob)
    assert names(client.get("/api/v1/teams/", {"name": "a"})) == ["Search"]
    assert client.get("/api/v1/teams/", {"priority_class": "platinum"}).status_code == 400


# --- the pages use the same FilterSets ------------------------------------------------------------


def page(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def test_the_deployment_list_page_filters_with_the_apis_filterset(bob, world):
    body = page(bob).get("/deployments/", {"state": "serving"}).content.decode()
    assert "search-llama" in body and "search-old" not in body and "ads-llama" not in body


def test_the_deployment_list_page_shows_a_bad_value_as_a_form_error_and_lists_nothing(bob, world):
    response = page(bob).get("/deployments/", {"state": "exploded"})
    assert response.status_code == 400
    body = response.content.decode()
    assert "Select a valid choice" in body and "search-llama" not in body


def test_the_deployment_list_page_refuses_another_teams_slug_without_its_rows(bob, world):
    response = page(bob).get("/deployments/", {"team": "ads"})
    assert response.status_code == 400
    assert "ads-llama" not in response.content.decode()


def test_the_node_list_page_filters_by_name(bob, dgx, pcie_box):
    body = page(bob).get("/nodes/", {"name": "pcie"}).content.decode()
    assert "pcie-v100-04" in body and "dgx-v100-01" not in body


def test_the_benchmark_list_page_refuses_a_bad_state_with_the_reason(bob, world):
    response = page(bob).get("/benchmarks/", {"state": "finished"})
    assert response.status_code == 400
    assert "Select a valid choice" in response.content.decode()


# --- the schema ---------------------------------------------------------------------------------


def test_the_openapi_schema_lists_each_lists_filters(alice):
    schema = api_client(alice).get("/api/schema/", {"format": "json"}).json()

    def parameters(path: str) -> set[str]:
        return {p["name"] for p in schema["paths"][path]["get"]["parameters"]}

    assert {"state", "desired_state", "team", "node", "profile", "model_version"} <= parameters(
        "/api/v1/deployments/"
    )
    assert {"node", "catalog_key", "health_state", "index"} <= parameters("/api/v1/gpus/")
    assert {"deployment", "profile", "mix", "state", "kind"} <= parameters("/api/v1/benchmark-runs/")
    assert {"state", "served_model", "deployment"} <= parameters("/api/v1/rollouts/")
    assert {"tensor_parallel_size", "dtype"} <= parameters("/api/v1/profiles/")


def test_the_keys_page_filters_a_teams_keys_and_refuses_an_unknown_class(bob, team):
    from portal.teams.services import api_key_create, api_key_revoke

    kept, _ = api_key_create(team=team, name="search-prod")
    gone, _ = api_key_create(team=team, name="search-old")
    api_key_revoke(api_key=gone)
    client = page(bob)
    body = client.get(f"/teams/{team.slug}/keys/", {"revoked": "true"}).content.decode()
    assert gone.prefix in body and kept.prefix not in body
    body = client.get(f"/teams/{team.slug}/keys/", {"name": "prod"}).content.decode()
    assert kept.prefix in body and gone.prefix not in body
    assert client.get(f"/teams/{team.slug}/keys/", {"priority_class": "platinum"}).status_code == 400
