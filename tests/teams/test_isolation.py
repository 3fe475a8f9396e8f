"""Two teams, a member each: A can never read, change or use B's keys, usage, deployments or runs.

One test per endpoint (REST API and pages), each asserting both the refusal and that
B's data is unchanged. The gateway's side is tests/gateway/test_isolation.py.
"""

from __future__ import annotations

import pytest
from django.test import Client
from django.utils import timezone

from portal.benchmarks.models import BenchmarkRun
from portal.deployments.models import Deployment
from portal.teams.models import ApiKey, Usage
from portal.teams.services import api_key_create
from tests.helpers import builders
from tests.helpers.clients import api_client

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("gateway_redis_db")]


def _deployment(team, name, llama7b, profile_tp1, dgx, gpu):
    return builders.deployment(
        name=name, team=team, model_version=llama7b, profile=profile_tp1, node=dgx, gpu_indices=[gpu],
        desired_state="running", state="serving", endpoint_url=f"http://127.0.0.1:{9000 + gpu}",
    )  # fmt: skip


def _usage(team, key, model):
    return Usage.objects.create(
        team=team, api_key=key, model=model, status="completed", http_status=200,
        created_at=timezone.now(), prompt_tokens=10, completion_tokens=5, duration_ms=10.0,
    )  # fmt: skip


class World:
    """Team A ("search", member bob) and team B ("ads", member dave), each with a deployment,
    a key, a usage record and a benchmark run of its deployment."""

    def __init__(self, bob, dave, a, b, llama7b, profile_tp1, dgx):
        self.bob, self.dave, self.a, self.b = bob, dave, a, b
        self.dep_a = _deployment(a, "search-llama", llama7b, profile_tp1, dgx, 0)
        self.dep_b = _deployment(b, "ads-llama", llama7b, profile_tp1, dgx, 1)
        self.key_a, _ = api_key_create(team=a, name="a-key")
        self.key_b, self.token_b = api_key_create(team=b, name="b-secret-key")
        self.usage_a = _usage(a, self.key_a, "model-of-a")
        self.usage_b = _usage(b, self.key_b, "model-of-b")
        self.run_b = BenchmarkRun.objects.create(
            deployment=self.dep_b, mix="short-qa", title="b-run", created_by=dave, state="succeeded"
        )


@pytest.fixture
def world(bob, team, django_user_model, llama7b, profile_tp1, dgx):
    dave = django_user_model.objects.create_user("dave", password="dave-password")
    ads = builders.team(name="Ads", slug="ads", gpu_quota=8)
    ads.members.add(dave)
    return World(bob, dave, team, ads, llama7b, profile_tp1, dgx)


def page(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


# --- REST API -------------------------------------------------------------------------


def test_api_deployment_list_shows_only_the_own_teams(world):
    names = [d["name"] for d in api_client(world.bob).get("/api/v1/deployments/").json()["results"]]
    assert names == ["search-llama"]


@pytest.mark.parametrize("suffix", ["", "timeline/", "samples/"])
def test_api_deployment_detail_of_another_team_is_404(world, suffix):
    assert api_client(world.bob).get(f"/api/v1/deployments/ads-llama/{suffix}").status_code == 404
    assert api_client(world.dave).get(f"/api/v1/deployments/ads-llama/{suffix}").status_code == 200


@pytest.mark.parametrize("action", ["start", "stop", "restart"])
def test_api_deployment_actions_on_another_team_are_refused(world, action):
    response = api_client(world.bob).post(f"/api/v1/deployments/ads-llama/{action}/")
    assert response.status_code in (403, 404)
    world.dep_b.refresh_from_db()
    assert (world.dep_b.desired_state, world.dep_b.state) == ("running", "serving")
    assert not world.dep_b.events.exists()


def test_api_deployment_delete_of_another_team_is_refused(world):
    assert api_client(world.bob).delete("/api/v1/deployments/ads-llama/").status_code in (403, 404)
    assert Deployment.objects.filter(name="ads-llama").exists()


def test_api_deployment_create_for_another_team_is_refused(world, llama7b, profile_tp1):
    body = {"name": "sneaky", "team": "ads", "model_version": llama7b.name, "profile": profile_tp1.name,
            "node": "dgx-v100-01", "gpu_indices": [2]}  # fmt: skip
    assert api_client(world.bob).post("/api/v1/deployments/", body, format="json").status_code == 403
    assert not Deployment.objects.filter(name="sneaky").exists()


def test_api_team_list_and_detail_show_only_the_own_team(world):
    client = api_client(world.bob)
    assert [t["slug"] for t in client.get("/api/v1/teams/").json()["results"]] == ["search"]
    assert client.get("/api/v1/teams/ads/").status_code == 404


def test_api_team_of_another_team_cannot_be_changed(world):
    client = api_client(world.bob)
    for method in ("patch", "put", "delete"):
        response = getattr(client, method)("/api/v1/teams/ads/", {"gpu_quota": 64}, format="json")
        assert response.status_code in (403, 404)
    world.b.refresh_from_db()
    assert world.b.gpu_quota == 8


def test_api_benchmark_runs_of_another_team_are_invisible(world):
    client = api_client(world.bob)
    assert client.get("/api/v1/benchmark-runs/").json()["results"] == []
    assert client.get("/api/v1/benchmark-runs/?deployment=ads-llama").json()["results"] == []
    assert client.get(f"/api/v1/benchmark-runs/{world.run_b.pk}/").status_code == 404
    assert api_client(world.dave).get(f"/api/v1/benchmark-runs/{world.run_b.pk}/").status_code == 200


def test_api_benchmark_run_actions_on_another_team_are_refused(world):
    client = api_client(world.bob)
    assert client.post(f"/api/v1/benchmark-runs/{world.run_b.pk}/cancel/").status_code == 404
    assert client.post(f"/api/v1/benchmark-runs/{world.run_b.pk}/apply-cap/").status_code in (403, 404)
    response = client.post(
        "/api/v1/benchmark-runs/", {"deployment": "ads-llama", "mix": "short-qa"}, format="json"
    )
    assert response.status_code == 404  # as if it did not exist
    world.run_b.refresh_from_db()
    assert not world.run_b.cancel_requested
    assert BenchmarkRun.objects.count() == 1


# --- pages ------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["", "keys/", "usage/"])
def test_team_pages_of_another_team_are_404(world, path):
    assert page(world.bob).get(f"/teams/ads/{path}").status_code == 404
    assert page(world.dave).get(f"/teams/ads/{path}").status_code == 200


def test_a_member_cannot_create_a_key_for_another_team(world):
    response = page(world.bob).post("/teams/ads/keys/", {"name": "sneaky"})
    assert response.status_code == 404
    assert not ApiKey.objects.filter(name="sneaky").exists()


def test_a_member_cannot_revoke_another_teams_key(world):
    client = page(world.bob)
    # Through the other team's URL, and through the own team's URL with the other's prefix.
    assert client.post(f"/teams/ads/keys/{world.key_b.prefix}/revoke/").status_code == 404
    assert client.post(f"/teams/search/keys/{world.key_b.prefix}/revoke/").status_code == 404
    world.key_b.refresh_from_db()
    assert world.key_b.revoked_at is None


def test_the_own_key_and_usage_pages_show_nothing_of_another_team(world):
    client = page(world.bob)
    keys = client.get("/teams/search/keys/").content.decode()
    assert world.key_a.prefix in keys and world.key_b.prefix not in keys and "b-secret-key" not in keys
    usage = client.get("/teams/search/usage/")
    assert usage.context["today"]["requests"] == 1  # its own record only


def test_deployment_pages_of_another_team_are_404(world):
    client = page(world.bob)
    assert client.get("/deployments/ads-llama/").status_code == 404
    listing = client.get("/deployments/").content.decode()
    assert "search-llama" in listing and "ads-llama" not in listing
    profile = client.get(f"/profiles/{world.dep_b.profile.name}/").content.decode()
    assert "ads-llama" not in profile


@pytest.mark.parametrize("action", ["start", "stop", "restart"])
def test_deployment_actions_of_another_team_are_refused(world, action):
    assert page(world.bob).post(f"/deployments/ads-llama/{action}/").status_code in (403, 404)
    world.dep_b.refresh_from_db()
    assert world.dep_b.desired_state == "running" and not world.dep_b.events.exists()


def test_benchmark_pages_of_another_team_are_404(world):
    client = page(world.bob)
    run = world.run_b.pk
    for url in [f"/benchmarks/{run}/", f"/benchmarks/{run}/progress.json", f"/benchmarks/{run}/export.json",
                f"/benchmarks/{run}/export.csv", f"/benchmarks/compare/?a={run}&b={run}"]:  # fmt: skip
        assert client.get(url).status_code == 404, url
    assert client.post(f"/benchmarks/{run}/cancel/").status_code == 404
    assert "b-run" not in client.get("/benchmarks/").content.decode()
    assert "b-run" not in client.get("/benchmarks/deployment/ads-llama/").content.decode()
    response = client.post(
        "/benchmarks/new/", {"deployment": "ads-llama", "mix": "short-qa", "concurrencies": "1"}
    )
    assert response.status_code in (200, 404)  # the form refuses a deployment it does not offer
    assert BenchmarkRun.objects.count() == 1


def test_the_admin_is_closed_to_members(world):
    client = page(world.bob)
    for url in ["/admin/teams/apikey/", "/admin/teams/usage/", "/admin/deployments/deployment/"]:
        response = client.get(url)
        assert response.status_code == 302 and "/admin/login/" in response["Location"]


def test_a_token_of_another_team_is_never_shown(world):
    """Not on any page a member of A can open (the secret is only ever shown once, to its creator)."""
    client = page(world.bob)
    secret = world.token_b.split(".", 1)[1]
    for url in ["/", "/teams/search/", "/teams/search/keys/", "/teams/search/usage/", "/deployments/"]:
        assert secret not in client.get(url).content.decode(), url
