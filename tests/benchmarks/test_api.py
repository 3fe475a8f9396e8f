"""REST API for benchmark runs."""

from __future__ import annotations

import pytest

from portal.benchmarks.models import BenchmarkRun, RunState
from portal.benchmarks.services import benchmark_run_execute
from tests.conftest import api_client

pytestmark = pytest.mark.django_db


def start(user, **body):
    return api_client(user).post(
        "/api/v1/benchmark-runs/",
        {"deployment": "search-7b", "mix": "fixed:16:8", "concurrencies": [2], "requests_per_level": 4}
        | body,
        format="json",
    )


def test_it_starts_a_run_and_reads_it_back_in_the_export_shape(bob, deployment):
    response = start(bob)
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
    run_id = start(bob).json()["id"]
    benchmark_run_execute(run_id=run_id)
    assert api_client(bob).post(f"/api/v1/benchmark-runs/{run_id}/apply-cap/").status_code == 400
    response = api_client(alice).post(f"/api/v1/benchmark-runs/{run_id}/apply-cap/")
    assert response.status_code == 200
    assert response.json()["concurrency_cap"] == 2
