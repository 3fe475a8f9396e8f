"""REST API for benchmark runs."""

from __future__ import annotations

import pytest

from portal.benchmarks.models import BenchmarkRun, RunState
from portal.benchmarks.services import benchmark_run_execute
from tests.helpers.clients import api_client

pytestmark = pytest.mark.django_db


def start(user, **body):
    return api_client(user).post(
        "/api/v1/benchmark-runs/",
        {"deployment": "search-7b", "mix": "fixed:16:8", "concurrencies": [2], "requests_per_level": 4}
        | body,
        format="json",
    )


def test_it_starts_a_run_and_reads_it_back_in_the_export_shape(alice, bob, deployment):
    response = start(alice)  # staff: straight to the engine (a member's run goes through the gateway)
    assert response.status_code == 201, response.json()
    run_id = response.json()["id"]
    benchmark_run_execute(run_id=run_id)
    data = api_client(bob).get(f"/api/v1/benchmark-runs/{run_id}/").json()
    assert data["run"]["state"] == "done"
    assert data["levels"][0]["concurrency"] == 2
    assert data["levels"][0]["completed"] == 4
    assert data["sla_concurrency"] == 2


def test_it_names_the_field_of_bad_input(bob, deployment):
    response = start(bob, mix="nope")
    assert response.status_code == 400
    assert "unknown mix" in response.json()["mix"][0]


def test_it_refuses_a_deeply_nested_inline_mix_naming_mix(bob, deployment):
    response = start(bob, mix='{"buckets": ' + "[" * 1500 + "]" * 1500 + "}")  # 3 k characters
    assert response.status_code == 400
    assert "nests at most" in response.json()["mix"][0]


def test_it_hides_runs_and_deployments_from_another_team(bob, charlie, deployment):
    run_id = start(bob).json()["id"]
    client = api_client(charlie)
    assert client.get(f"/api/v1/benchmark-runs/{run_id}/").status_code == 404
    assert run_id not in [r["id"] for r in _results(client.get("/api/v1/benchmark-runs/").json())]
    assert start(charlie).status_code == 404
    assert client.post(f"/api/v1/benchmark-runs/{run_id}/cancel/").status_code == 404


def _results(payload):
    return payload["results"] if isinstance(payload, dict) else payload


def test_it_cancels_a_queued_run(bob, deployment):
    run_id = start(bob).json()["id"]
    response = api_client(bob).post(f"/api/v1/benchmark-runs/{run_id}/cancel/")
    assert response.status_code == 200
    assert BenchmarkRun.objects.get(pk=run_id).state == RunState.CANCELLED


def test_it_applies_the_cap_for_staff_only(alice, bob, deployment):
    run_id = start(alice).json()["id"]
    benchmark_run_execute(run_id=run_id)
    assert api_client(bob).post(f"/api/v1/benchmark-runs/{run_id}/apply-cap/").status_code == 400
    response = api_client(alice).post(f"/api/v1/benchmark-runs/{run_id}/apply-cap/")
    assert response.status_code == 200
    assert response.json()["concurrency_cap"] == 2


def test_it_benchmarks_an_adopted_endpoint_without_profile_or_node(alice, team, llama7b, fake_server):
    from portal.deployments.models import Deployment
    from portal.deployments.services import endpoint_register

    adopted = endpoint_register(
        name="adopted-7b", team=team, model_version=llama7b, url=f"{fake_server.url}/v1"
    )
    Deployment.objects.filter(pk=adopted.pk).update(state="serving")
    response = start(alice, deployment="adopted-7b")
    assert response.status_code == 201, response.content
    run = BenchmarkRun.objects.get(pk=response.json()["id"])
    assert run.snapshot["adopted"] is True
    assert run.snapshot["profile"] == {} and run.snapshot["node"] == {} and run.snapshot["gpus"] == []
    benchmark_run_execute(run_id=run.pk)
    run.refresh_from_db()
    assert run.state == RunState.DONE, run.state_reason
    page = api_client(alice).get(f"/api/v1/benchmark-runs/{run.pk}/")
    assert page.status_code == 200 and page.json()["levels"][0]["completed"] == 4
