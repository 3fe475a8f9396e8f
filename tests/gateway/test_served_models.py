"""Served model names (issue 26): a stable name points at versions with traffic shares; the gateway
draws a version per request, a version's own name keeps working, `/v1/models` lists the stable name,
and usage tells which version served each request (through its deployment)."""

from __future__ import annotations

import datetime as dt
import random
import uuid
from collections import Counter

import httpx
import pytest

from devtools import wait_until
from tests.helpers.gateway import chat_body, make_setup


def _second_version(setup, upstream: str):
    """Another model version of the same architecture, served by its own deployment."""
    return make_setup(team=setup.team, node=setup.deployment.node, upstream=upstream)


@pytest.fixture
def split(transactional_db, team, cpu_node, fake_upstream, gw_redis):
    """Two versions on the fake upstream (which echoes the `model` it receives) behind one served
    name at 30/70, and a key that may call the served name and the second version."""
    from portal.registry.services import served_model_create
    from portal.teams.services import api_key_create

    old = make_setup(team=team, node=cpu_node, upstream=fake_upstream)
    new = _second_version(old, fake_upstream)
    name = f"chat-{uuid.uuid4().hex[:8]}"
    served_model_create(name=name, shares={old.model: 3000, new.model: 7000})
    _, token = api_key_create(team=team, name="split", allowed_models=[name, new.model])
    return name, old, new, {"Authorization": f"Bearer {token}"}


def test_it_draws_versions_by_share_with_a_seeded_draw(db, llama7b):
    from portal.gateway.routing import Replica, Route

    def version(name: str, team_id: int = 1) -> Route:
        replica = Replica(
            1, name, "http://x", None, team_id, False, httpx.URL("http://x"), httpx.URL("http://x")
        )
        return Route(name, True, (replica,), None)

    served = Route("chat", True, (), None, ((3000, version("v1")), (7000, version("v2"))))
    draw = random.Random(26)  # noqa: S311 (a reproducible draw, not a secret)
    counts = Counter(served.pick(1, draw).model for _ in range(20_000))
    assert abs(counts["v1"] / 20_000 - 0.30) < 0.015
    # A version this team cannot reach takes no share: the other gets every request.
    served = Route("chat", True, (), None, ((3000, version("v1", team_id=2)), (7000, version("v2"))))
    assert {served.pick(1, draw).model for _ in range(200)} == {"v2"}


@pytest.mark.slow  # hundreds of requests through the gateway
def test_it_splits_a_served_name_30_70_and_records_the_version_per_request(gateway, split):
    from portal.teams.models import Usage
    from portal.teams.services import usage_flush

    name, old, new, headers = split
    served_by = Counter()
    total = 400
    with httpx.Client(timeout=30) as client:
        for _ in range(total):
            response = client.post(
                f"{gateway.url}/v1/chat/completions", headers=headers, json=chat_body(name, max_tokens=1)
            )
            assert response.status_code == 200, response.text
            served_by[response.json()["model"]] += 1  # the version's name, as an alias answers
    assert set(served_by) == {old.model, new.model}
    # 30 % of 400 is 120 with a standard deviation of 9.2: 80..160 fails once in 10^5 runs.
    assert 80 <= served_by[old.model] <= 160, served_by

    usage_flush()
    rows = Usage.objects.filter(model=name).select_related("deployment__model_version")
    assert rows.count() == total
    per_version = Counter(row.deployment.model_version.name for row in rows)
    assert per_version == served_by  # the deployment id recorded per request names its version


def test_it_still_routes_a_versions_own_name(gateway, split):
    _, old, new, headers = split
    response = httpx.post(
        f"{gateway.url}/v1/chat/completions",
        headers=headers,
        json=chat_body(new.model, max_tokens=1),
        timeout=30,
    )
    assert response.status_code == 200, response.text
    assert response.json()["model"] == new.model
    # The key may call the served name and the new version, not the old version by its own name.
    refused = httpx.post(
        f"{gateway.url}/v1/chat/completions",
        headers=headers,
        json=chat_body(old.model, max_tokens=1),
        timeout=30,
    )
    assert refused.status_code in (403, 404), refused.text


def test_it_lists_the_served_name_a_key_may_call(gateway, split, team, bob):
    from portal.teams.selectors import model_names_for_team

    name, old, new, headers = split
    listed = {
        m["id"] for m in httpx.get(f"{gateway.url}/v1/models", headers=headers, timeout=30).json()["data"]
    }
    assert listed == {name, new.model}
    # An unscoped key lists it too, beside the versions.
    from portal.teams.services import api_key_create

    _, token = api_key_create(team=team, name="any")

    def unscoped_listing() -> set[str]:
        auth = {"Authorization": f"Bearer {token}"}
        answer = httpx.get(f"{gateway.url}/v1/models", headers=auth, timeout=30)
        return {m["id"] for m in answer.json()["data"]}

    # The list of every served model is one cache entry per gateway process (GATEWAY_CACHE_S, 30 s
    # here): an earlier test may have filled it before these deployments existed.
    everything = {name, old.model, new.model}
    wait_until(lambda: everything <= unscoped_listing(), timeout_s=45, what="the served name listed")
    assert name in model_names_for_team(team)


def test_it_validates_shares(db, llama7b):
    from portal.core.errors import ApplicationError
    from portal.registry.services import served_model_create

    with pytest.raises(ApplicationError, match="add up to 90 %"):
        served_model_create(name="chat-x", shares={llama7b.name: 9000})
    with pytest.raises(ApplicationError, match="basis points"):
        served_model_create(name="chat-x", shares={llama7b.name: 10_001})
    with pytest.raises(ApplicationError, match="version's name"):
        served_model_create(name=llama7b.name, shares={llama7b.name: 10_000})
    with pytest.raises(ApplicationError, match="No model version"):
        served_model_create(name="chat-x", shares={"nope": 10_000})


def test_it_refuses_a_version_named_like_a_served_name(db, llama7b):
    from portal.core.errors import ApplicationError
    from portal.registry.services import model_version_create, served_model_create
    from tests.helpers.samples import bundled_config

    served_model_create(name="chat-y", shares={llama7b.name: 10_000})
    with pytest.raises(ApplicationError, match="served model name"):
        model_version_create(name="chat-y", config=bundled_config("llama-2-7b-chat-hf"))


@pytest.mark.slow  # a gateway of its own with a one-second route cache, and a failing upstream
def test_a_failing_new_version_is_rolled_back_from_its_gateway_errors(
    team, cpu_node, fake_upstream, gw_redis, transactional_db, tmp_path, settings
):
    """The whole chain on real components: the gateway's usage records → the latency rollup → the
    rollout's evaluation → shares → the gateway sends nothing more to the new version."""
    from devtools import stop, wait_until
    from portal.observability.services import latency_rollup
    from portal.registry.services import served_model_create
    from portal.rollouts.services import rollout_evaluate, rollout_start
    from portal.teams.services import api_key_create, usage_flush
    from tests.helpers.gateway import spawn_fake_upstream, start_gateway

    settings.ROLLOUT_MIN_REQUESTS = 5
    broken_url, broken = spawn_fake_upstream(5, "--status", "500")
    gateway, process = start_gateway(tmp_path / "gateway.log", GATEWAY_CACHE_S="1")
    try:
        old = make_setup(team=team, node=cpu_node, upstream=fake_upstream)
        new = _second_version(old, broken_url)
        version = new.deployment.model_version  # a rollout moves traffic only to one with release hashes
        type(version).objects.filter(pk=version.pk).update(weights_sha256="a" * 64, tokenizer_sha256="b" * 64)
        version.refresh_from_db()
        name = f"chat-{uuid.uuid4().hex[:8]}"
        served = served_model_create(name=name, shares={old.model: 10_000})
        _, token = api_key_create(team=team, name="rollout", allowed_models=[name])
        headers = {"Authorization": f"Bearer {token}"}
        rollout = rollout_start(
            served_model=served,
            to_deployment=new.deployment,
            from_deployment=old.deployment,
            steps=[[50, 1], [100, 1]],
        )
        assert rollout_evaluate(rollout=rollout) == "serving"  # 50 % to the new version

        def call() -> httpx.Response:
            return httpx.post(
                f"{gateway.url}/v1/chat/completions",
                headers=headers,
                json=chat_body(name, max_tokens=1),
                timeout=30,
            )

        statuses = Counter(call().status_code for _ in range(40))
        assert statuses[502] >= 5 and statuses[200] >= 5, statuses  # the new version fails its share

        usage_flush()
        from django.utils import timezone

        from portal.teams.models import Usage

        # A request that failed on every replica is recorded against the last one it tried.
        failed = Usage.objects.filter(model=name, status="upstream_error")
        assert failed.count() == statuses[502]
        assert set(failed.values_list("deployment_id", flat=True)) == {new.deployment.pk}

        now = timezone.now()
        latency_rollup(since=now - dt.timedelta(minutes=2), until=now + dt.timedelta(minutes=1))
        assert rollout_evaluate(rollout=rollout) == "rolled_back"  # one evaluation
        rollout.refresh_from_db()
        assert "error rate 100.0%" in rollout.reason
        assert rollout.measurements["new"]["errors"] == statuses[502]

        # Once the gateway's cached route has expired (1 s) and reloaded, every request goes to the
        # old version. Until then half still fail on the new one, so the wait asks for 30 answers in
        # a row from the old version: 5 in a row came by chance from the cached 50/50 split in CI.
        def old_serves_alone() -> bool:
            return all(
                (answer := call()).status_code == 200 and answer.json().get("model") == old.model
                for _ in range(30)
            )

        try:
            wait_until(old_serves_alone, timeout_s=30, what="30 answers in a row from the old version")
        except AssertionError as error:
            log = gateway.log_text()[-3000:]
            raise AssertionError(f"{error}; the gateway's log ends:\n{log}") from None
    finally:
        stop(process)
        stop(broken)


def test_a_version_ops_hide_is_callable_only_through_the_served_name(gateway, split):
    from portal.registry.models import ModelVersion

    name, _, new, headers = split
    ModelVersion.objects.filter(name=new.model).update(callable_by_name=False)  # before any route load
    refused = httpx.post(
        f"{gateway.url}/v1/chat/completions",
        headers=headers,
        json=chat_body(new.model, max_tokens=1),
        timeout=30,
    )
    assert refused.status_code == 404 and refused.json()["error"]["code"] == "model_not_found"
    listed = {
        m["id"] for m in httpx.get(f"{gateway.url}/v1/models", headers=headers, timeout=30).json()["data"]
    }
    assert listed == {name}
    served_by = {
        httpx.post(
            f"{gateway.url}/v1/chat/completions",
            headers=headers,
            json=chat_body(name, max_tokens=1),
            timeout=30,
        ).json()["model"]
        for _ in range(20)
    }
    assert new.model in served_by  # 70 % of 20 draws: it still serves the served name
