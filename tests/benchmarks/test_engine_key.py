"""Benchmarks of a server started with an API key send it (vLLM refuses /v1/* without it)."""

from __future__ import annotations

import pytest

from portal.benchmarks.models import RunState
from portal.benchmarks.services import BenchmarkRunRequest, benchmark_run_create, benchmark_run_execute
from tests.helpers import builders
from tests.helpers.builders import make_serving_deployment

pytestmark = pytest.mark.django_db


@pytest.fixture
def keyed_deployment(team, llama7b, profile_tp8, dgx, fake_server_factory):
    from portal.deployments.models import Deployment

    deployment = make_serving_deployment(
        team=team, model=llama7b, profile=profile_tp8, node=dgx, url=fake_server_factory(api_key="k-1").url
    )
    Deployment.objects.filter(pk=deployment.pk).update(engine_api_key="k-1")
    deployment.refresh_from_db()
    return deployment


def test_it_benchmarks_a_keyed_deployment_with_its_key(alice, keyed_deployment):
    run = benchmark_run_create(
        user=alice,
        run_request=BenchmarkRunRequest(
            deployment=keyed_deployment, mix="fixed:16:8", concurrencies=[2], requests_per_level=4
        ),
    )
    benchmark_run_execute(run_id=run.pk)
    run.refresh_from_db()
    assert run.state == RunState.DONE, run.state_reason
    level = run.levels.get().results
    assert level["completed"] == 4 and level.get("failed", 0) == 0
    assert "k-1" not in str(run.config) + str(run.snapshot) + run.state_reason


def test_it_benchmarks_a_keyed_server_given_by_url_with_the_key_of_the_deployment_there(
    alice, keyed_deployment
):
    run = benchmark_run_create(
        user=alice,
        run_request=BenchmarkRunRequest(
            endpoint_url=f"{keyed_deployment.endpoint_url}/v1",
            model_name="llama-2-7b-chat-hf",
            mix="fixed:16:8",
            concurrencies=[1],
            requests_per_level=2,
        ),
    )
    benchmark_run_execute(run_id=run.pk)
    run.refresh_from_db()
    assert run.state == RunState.DONE, run.state_reason


def test_it_refuses_a_queued_run_whose_deployment_was_deleted_even_if_another_serves_at_its_url(
    bob, charlie, keyed_deployment, llama7b, profile_tp8, dgx
):
    from portal.deployments.models import Deployment

    run = benchmark_run_create(
        user=bob,
        run_request=BenchmarkRunRequest(
            deployment=keyed_deployment, mix="fixed:16:8", concurrencies=[1], requests_per_level=2
        ),
    )
    url = keyed_deployment.endpoint_url
    Deployment.objects.filter(pk=keyed_deployment.pk).delete()
    # Another team's server later takes the same address (and the fake server its key).
    other = builders.team(name="Ads", slug="ads", gpu_quota=8)
    other.members.add(charlie)
    theirs = make_serving_deployment(
        team=other, model=llama7b, profile=profile_tp8, node=dgx, url=url, name="ads-7b"
    )
    Deployment.objects.filter(pk=theirs.pk).update(engine_api_key="k-1")

    benchmark_run_execute(run_id=run.pk)
    run.refresh_from_db()
    assert run.state == RunState.FAILED
    assert "search-7b was deleted" in run.state_reason
    assert not run.levels.exists()


def test_it_refuses_a_queued_run_whose_deployment_no_longer_serves(bob, keyed_deployment):
    from portal.deployments.models import Deployment

    run = benchmark_run_create(
        user=bob,
        run_request=BenchmarkRunRequest(
            deployment=keyed_deployment, mix="fixed:16:8", concurrencies=[1], requests_per_level=2
        ),
    )
    Deployment.objects.filter(pk=keyed_deployment.pk).update(state="stopped")
    benchmark_run_execute(run_id=run.pk)
    run.refresh_from_db()
    assert run.state == RunState.FAILED and "search-7b is stopped, not serving" in run.state_reason
