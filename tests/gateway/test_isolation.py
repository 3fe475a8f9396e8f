"""Team isolation in the gateway: a key reaches its own team's deployments and shared ones only.

A model served only by another team's (unshared) deployment answers exactly as a
registered model that nobody serves: 503 `no_replica`, and it is not listed.
"""

from __future__ import annotations

import uuid

import httpx
import pytest

from devtools import stop, wait_until
from portal.core.redis.client import redis_keys
from tests.helpers import builders
from tests.helpers.gateway import chat_body, make_setup, spawn_fake_upstream, upstream_reset, upstream_stats

pytestmark = [pytest.mark.django_db(transaction=True)]


@pytest.fixture(scope="module")
def second_upstream():
    """Another fake upstream, so a test can tell which team's replica took a request."""
    url, process = spawn_fake_upstream(1)
    yield url
    stop(process)


@pytest.fixture
def other_team(db):

    return builders.team(name=f"Ads {uuid.uuid4().hex[:6]}", slug=f"ads-{uuid.uuid4().hex[:6]}")


def _error(response: httpx.Response) -> dict:
    return response.json()["error"]


def _call(gateway, token: str, model: str) -> httpx.Response:
    return httpx.post(
        f"{gateway.url}/v1/chat/completions",
        headers={"Authorization": f"Bearer {token}"},
        json=chat_body(model, max_tokens=2),
        timeout=10,
    )


def _listed(gateway, token: str) -> list[str]:
    response = httpx.get(f"{gateway.url}/v1/models", headers={"Authorization": f"Bearer {token}"})
    assert response.status_code == 200
    return [m["id"] for m in response.json()["data"]]


def test_a_key_cannot_use_a_model_only_another_team_serves(gateway, serving, other_team, gw_redis):
    from portal.registry.services import model_version_create
    from portal.teams.services import api_key_create
    from tests.helpers.samples import bundled_config

    theirs = make_setup(team=other_team, node=serving.deployment.node, upstream=serving.upstream)
    _key, ours = api_key_create(team=serving.team)  # any model
    nobody = f"m-{uuid.uuid4().hex[:8]}"
    model_version_create(name=nobody, config=bundled_config("llama-2-7b-chat-hf"))
    upstream_reset(serving.upstream)

    refused, unserved = _call(gateway, ours, theirs.model), _call(gateway, ours, nobody)
    assert refused.status_code == unserved.status_code == 503
    # The same answer as a model nobody serves, but for its name: nothing about the other team leaks.
    assert _error(refused) == {
        **_error(unserved),
        "message": _error(unserved)["message"].replace(nobody, theirs.model),
    }
    assert refused.headers["retry-after"] == unserved.headers["retry-after"]
    assert upstream_stats(serving.upstream)["started"] == 0
    assert theirs.model not in _listed(gateway, ours)
    # A key scoped to that model sees nothing either.
    _key, scoped = api_key_create(team=serving.team, allowed_models=[theirs.model])
    assert _listed(gateway, scoped) == []
    assert _call(gateway, scoped, theirs.model).status_code == 503
    # Their own key works: the refusal is about the team, not the model.
    assert _call(gateway, theirs.token, theirs.model).status_code == 200
    assert serving.model not in _listed(gateway, theirs.token)


def test_a_shared_deployment_serves_every_team(gateway, serving, other_team, gw_redis):
    from portal.teams.services import api_key_create

    theirs = make_setup(team=other_team, node=serving.deployment.node, upstream=serving.upstream)
    theirs.deployment.shared = True
    theirs.deployment.save()
    # Scoped to the model: /v1/models then reads its route, not the (cached) list of all served models.
    _key, ours = api_key_create(team=serving.team, allowed_models=[theirs.model])
    assert _call(gateway, ours, theirs.model).status_code == 200
    assert _listed(gateway, ours) == [theirs.model]


def test_a_key_never_reaches_another_teams_replica_of_its_model(
    gateway, serving, other_team, second_upstream, gw_redis
):

    builders.deployment(
        name=f"theirs-{uuid.uuid4().hex[:8]}",
        team=other_team,
        model_version=serving.deployment.model_version,
        profile=serving.deployment.profile,
        node=serving.deployment.node,
        desired_state="running",
        state="serving",
        endpoint_url=second_upstream,
    )
    upstream_reset(serving.upstream)
    upstream_reset(second_upstream)
    for _ in range(6):
        assert _call(gateway, serving.token, serving.model).status_code == 200
    assert upstream_stats(serving.upstream)["completed"] == 6
    assert upstream_stats(second_upstream)["started"] == 0


def test_usage_is_billed_to_the_callers_team_only(gateway, serving, other_team, gw_redis):
    from portal.teams.models import Usage
    from portal.teams.services import usage_flush

    theirs = make_setup(team=other_team, node=serving.deployment.node, upstream=serving.upstream)
    assert _call(gateway, serving.token, serving.model).status_code == 200
    assert _call(gateway, theirs.token, serving.model).status_code == 403  # their key is scoped
    assert _call(gateway, theirs.token, theirs.model).status_code == 200
    # Usage records are queued by the gateway after the response: wait for them.
    wait_until(lambda: gw_redis.llen(redis_keys().usage) >= 3, what="three usage records queued")
    usage_flush()
    ours = Usage.objects.filter(team=serving.team)
    assert {u.api_key_id for u in ours} == {serving.key.pk}
    assert {u.api_key_id for u in Usage.objects.filter(team=other_team)} == {theirs.key.pk}


@pytest.fixture
def html_upstream():
    """Whatever else listens where an engine was adopted (a proxy, a metadata service): every
    request gets an HTML page, `status` of the test's choosing."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    state = {"status": 403}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("content-length", 0)))
            body = b"<html><body><script>alert(document.cookie)</script>Forbidden</body></html>"
            self.send_response(state["status"])
            self.send_header("content-type", "text/html; charset=utf-8")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield state, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.mark.parametrize("status", [400, 200])
def test_an_upstreams_html_page_never_reaches_the_client_as_is(
    gateway, team, cpu_node, html_upstream, gw_redis, status
):
    state, url = html_upstream
    state["status"] = status
    setup = make_setup(team=team, node=cpu_node, upstream=url)
    response = _call(gateway, setup.token, setup.model)
    assert response.status_code == (400 if status == 400 else 502)
    assert response.headers["content-type"] == "application/json"
    assert b"<script>" not in response.content
    assert _error(response)["code"] == "upstream_error"
