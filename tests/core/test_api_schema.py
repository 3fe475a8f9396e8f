"""What fuzzing the API on real rows found: answers that did not match the API's own schema (now
documented as they are, each real response validated against /api/schema/ by schemathesis), and
deletes of rows still in use (a 500, now a 409)."""

from __future__ import annotations

import pytest
import schemathesis

from portal.benchmarks.models import BenchmarkRun
from portal.deployments.models import Deployment, MetricsSample
from tests.helpers import builders
from tests.helpers.clients import api_client, basic_auth

pytestmark = pytest.mark.django_db


@pytest.fixture
def schema(wsgi_app, alice, team, dgx, llama7b, profile_tp8):
    deployment = builders.deployment(
        name="search-llama", team=team, model_version=llama7b, profile=profile_tp8, node=dgx,
        gpu_indices=list(range(8)), desired_state="stopped", state="stopped",  # endpoint_url blank
    )  # fmt: skip
    MetricsSample.objects.create(deployment=deployment, healthy=True, running=1)
    # An imported table: no profile, no endpoint.
    BenchmarkRun.objects.create(
        deployment=deployment, kind="imported", mix="x", state="done", sla_concurrency=4
    )
    headers = basic_auth("alice", "alice-password")
    return schemathesis.openapi.from_wsgi("/api/schema/", wsgi_app, headers=headers)


def _validate(schema, method: str, path: str, **path_parameters) -> None:
    operation = schema[path][method]
    headers = basic_auth("alice", "alice-password")
    response = operation.Case(path_parameters=path_parameters).call(headers=headers)
    assert response.status_code == 200, response.text
    operation.validate_response(response)  # raises with the violations


@pytest.mark.parametrize("action", ["timeline", "samples"])
def test_a_deployments_timeline_and_samples_are_plain_lists(schema, action):
    _validate(schema, "GET", f"/api/v1/deployments/{{name}}/{action}/", name="search-llama")


def test_a_deployment_without_an_endpoint_matches_its_schema(schema):
    _validate(schema, "GET", "/api/v1/deployments/{name}/", name="search-llama")
    _validate(schema, "GET", "/api/v1/deployments/")


def test_a_run_without_profile_or_endpoint_matches_its_schema(schema):
    _validate(schema, "GET", "/api/v1/benchmark-runs/")
    run = BenchmarkRun.objects.get()
    _validate(schema, "GET", "/api/v1/benchmark-runs/{id}/", id=run.pk)  # the export shape
    _validate(schema, "POST", "/api/v1/benchmark-runs/{id}/apply-cap/", id=run.pk)


@pytest.mark.parametrize(
    "url",
    ["/api/v1/model-versions/llama-2-7b-chat-hf/", "/api/v1/nodes/dgx-v100-01/", "/api/v1/teams/search/",
     "/api/v1/profiles/v100-7b-fp16-tp8/"],
)  # fmt: skip
def test_deleting_a_row_still_in_use_is_a_409_naming_what_uses_it(schema, alice, url):
    """Was a 500 (ProtectedError), found by fuzzing the API on real rows."""
    response = api_client(alice).delete(url)
    assert response.status_code == 409, response.content
    assert "search-llama" in response.json()["detail"] or "v100-7b-fp16-tp8" in response.json()["detail"]
    assert Deployment.objects.filter(name="search-llama").exists()
