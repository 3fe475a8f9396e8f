"""A member's benchmark is the team's traffic: it goes through the real gateway (uvicorn serving
portal.asgi against the test database) as the member's hidden benchmark key, pinned to the
deployment measured; the job runs in this process against the benchmarks' fake server."""

from __future__ import annotations

import time
import uuid

import pytest

from portal.benchmarks.models import RunState
from portal.benchmarks.services import BenchmarkRunRequest, benchmark_run_create, benchmark_run_execute
from portal.teams.models import ApiKey, Usage
from portal.teams.selectors import api_keys_of
from portal.teams.services import api_key_matches, usage_flush
from tests.helpers import builders

pytestmark = [pytest.mark.django_db(transaction=True)]


def serving_deployment(*, team, node, version, url: str):
    from portal.deployments.models import DeploymentProfile

    profile = DeploymentProfile.objects.get_or_create(name=f"p-{version.name}", model_version=version)[0]
    return builders.deployment(
        name=f"d-{uuid.uuid4().hex[:8]}",
        team=team,
        model_version=version,
        profile=profile,
        node=node,
        desired_state="running",
        state="serving",
        endpoint_url=url,
    )


def flushed_usage(team, *, at_least: int, deadline_s: float = 15) -> list[Usage]:
    deadline = time.monotonic() + deadline_s
    while True:
        usage_flush()
        rows = list(Usage.objects.filter(team=team).select_related("api_key"))
        if len(rows) >= at_least or time.monotonic() > deadline:
            return rows
        time.sleep(0.1)


@pytest.fixture
def fresh_model(db):
    from portal.registry.services import model_version_create
    from tests.helpers.samples import bundled_config

    # A name the gateway process has never cached a route for.
    return model_version_create(name=f"m-{uuid.uuid4().hex[:8]}", config=bundled_config("llama-2-7b-chat-hf"))


def test_it_sends_a_members_run_through_the_gateway_under_the_teams_quotas_and_accounts_it(
    gateway, gw_redis, settings, client, bob, team, cpu_node, fresh_model, fake_server_factory,
    monkeypatch,
):  # fmt: skip
    from portal.benchmarks.services import execution

    issued: list[str] = []  # every secret the key was given, as the job received it
    new_secret = execution.api_key_new_secret

    def recording_new_secret(**changes) -> str:
        issued.append(new_secret(**changes))
        return issued[-1]

    monkeypatch.setattr(execution, "api_key_new_secret", recording_new_secret)
    settings.BENCHMARK_GATEWAY_URL = gateway.url
    team.tokens_per_day, team.max_tokens_clamp = 100, 16
    team.save(update_fields=["tokens_per_day", "max_tokens_clamp"])
    # Two replicas of the model; the run measures the second only (the first must see nothing).
    other = fake_server_factory(model=fresh_model.name)
    measured = fake_server_factory(model=fresh_model.name)
    serving_deployment(team=team, node=cpu_node, version=fresh_model, url=other.url)
    deployment = serving_deployment(team=team, node=cpu_node, version=fresh_model, url=measured.url)

    run = benchmark_run_create(
        user=bob,
        run_request=BenchmarkRunRequest(
            deployment=deployment, mix="fixed:16:1000", concurrencies=[1], requests_per_level=16
        ),
    )
    benchmark_run_execute(run_id=run.pk)
    run.refresh_from_db()

    assert run.state == RunState.DONE, run.state_reason
    assert "through the gateway as benchmark (bob)" in run.notes
    level = run.levels.get().results
    # The daily budget of 100 tokens runs out after a few requests: the rest are refused.
    assert level["completed"] < 4 and level["failed"] > 12, level["errors"]
    assert any("429" in reason and "tokens per day" in reason for reason in level["errors"]), level["errors"]
    assert level["total_output_tokens"] <= 16 * level["completed"]  # the clamp, not 1,000
    assert other.server.received == 0 and measured.server.received > 0
    assert level["metrics_scrapes"] > 0  # the engine's own /metrics, read directly

    key = ApiKey.objects.get(team=team, benchmark_user=bob)
    assert key.name == "benchmark (bob)" and key.source == "benchmark"
    assert key.pinned_deployment_id == deployment.pk and key.allowed_models == [fresh_model.name]
    assert key not in api_keys_of(team)  # nothing to manage: its secret existed only in the run
    # The run's secret died with it: the key now has another, which nobody was given.
    assert len(issued) == 2 and not api_key_matches(issued[0], key.digest)
    rows = flushed_usage(team, at_least=18)  # calibration, warm-up and 16 measured requests
    assert len(rows) >= 18 and {row.api_key_id for row in rows} == {key.pk}
    completed = [row for row in rows if row.status == "completed"]
    assert completed and all(row.completion_tokens <= 16 for row in completed)
    assert any(row.completion_tokens == 16 for row in completed)  # the warm-up asked for 1,000
    assert sum(row.status == "rejected" and row.http_status == 429 for row in rows) > 12
    assert {row.deployment_id for row in completed} == {deployment.pk}

    client.force_login(bob)
    assert "through the gateway as benchmark (bob)" in client.get(run.get_absolute_url()).content.decode()
    page = client.get(f"/teams/{team.slug}/usage/").content.decode()
    assert "benchmark (bob)" in page and "<td>benchmark</td>" in page


def test_it_runs_staff_benchmarks_straight_to_the_engine(
    gateway, gw_redis, settings, alice, team, cpu_node, fresh_model, fake_server_factory
):
    settings.BENCHMARK_GATEWAY_URL = gateway.url
    team.tokens_per_day, team.max_tokens_clamp = 100, 16
    team.save(update_fields=["tokens_per_day", "max_tokens_clamp"])
    server = fake_server_factory(model=fresh_model.name)
    deployment = serving_deployment(team=team, node=cpu_node, version=fresh_model, url=server.url)
    run = benchmark_run_create(
        user=alice,
        run_request=BenchmarkRunRequest(
            deployment=deployment, mix="fixed:16:32", concurrencies=[1], requests_per_level=4
        ),
    )
    benchmark_run_execute(run_id=run.pk)
    run.refresh_from_db()
    assert run.state == RunState.DONE, run.state_reason
    assert run.levels.get().results["total_output_tokens"] == 4 * 32
    assert not ApiKey.objects.filter(benchmark_user__isnull=False).exists()
    assert flushed_usage(team, at_least=1, deadline_s=1) == []


def test_it_benchmarks_a_version_callable_only_through_a_served_name_through_that_name(
    gateway, gw_redis, settings, bob, team, cpu_node, fake_server_factory
):
    from portal.registry.models import ModelVersion
    from portal.registry.services import model_version_create, served_model_create
    from tests.helpers.samples import bundled_config

    settings.BENCHMARK_GATEWAY_URL = gateway.url
    versions = [
        model_version_create(name=f"m-{uuid.uuid4().hex[:8]}", config=bundled_config("llama-2-7b-chat-hf"))
        for _ in range(2)
    ]
    ModelVersion.objects.filter(pk__in=[v.pk for v in versions]).update(callable_by_name=False)
    servers = [fake_server_factory(model=version.name) for version in versions]
    deployments = [
        serving_deployment(team=team, node=cpu_node, version=version, url=server.url)
        for version, server in zip(versions, servers, strict=True)
    ]
    # Half the name's traffic goes to each version: the run still reaches only the one measured.
    served_model_create(name=f"chat-{uuid.uuid4().hex[:6]}", shares={v.name: 5000 for v in versions})

    run = benchmark_run_create(
        user=bob,
        run_request=BenchmarkRunRequest(
            deployment=deployments[0], mix="fixed:16:8", concurrencies=[2], requests_per_level=8
        ),
    )
    benchmark_run_execute(run_id=run.pk)
    run.refresh_from_db()

    assert run.state == RunState.DONE, run.state_reason
    level = run.levels.get().results
    assert level["completed"] == 8 and level["failed"] == 0, level["errors"]
    assert servers[0].server.received > 0 and servers[1].server.received == 0
