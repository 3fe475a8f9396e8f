"""The playground's chat through the real gateway pipeline: uvicorn serving portal.asgi (pages and
gateway in one process, as in production) in front of the fake upstream."""

from __future__ import annotations

import json
import secrets
import uuid

import httpx
import pytest
from django.test import Client

from devtools import wait_until
from portal.teams.models import ApiKey, Usage
from portal.teams.services import usage_flush
from tests.helpers.gateway import NO_FIRST_TOKEN_IN_TIME, upstream_stats

pytestmark = [pytest.mark.django_db(transaction=True)]


def member_session(gateway, user) -> httpx.Client:
    """An HTTP client signed in as `user` (a real session row), with a CSRF cookie and header."""
    django_client = Client()
    django_client.force_login(user)
    csrf = secrets.token_hex(16)  # 32 characters: a valid unmasked CSRF secret
    return httpx.Client(
        base_url=gateway.url,
        cookies={"sessionid": django_client.cookies["sessionid"].value, "csrftoken": csrf},
        headers={"X-CSRFToken": csrf},
        timeout=30,
    )


def chat(session: httpx.Client, model: str, content: str = "Hello", **changes) -> httpx.Response:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "system": "Be brief.",
        "max_tokens": 8,
        "temperature": 0.2,
        **changes,
    }
    return session.post("/teams/search/playground/chat", json=body)


def flushed_usage(team, deadline_s: float = 10) -> list[Usage]:
    def rows() -> list[Usage]:
        usage_flush()
        return list(Usage.objects.filter(team=team).select_related("api_key"))

    return wait_until(rows, timeout_s=deadline_s, what="the team's usage flushed", interval_s=0.1)


def events(content: bytes) -> list[dict | str]:
    out = []
    for block in content.decode().split("\n\n"):
        if block.startswith("data: "):
            data = block[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_it_streams_the_reply_and_accounts_it_to_the_team_as_the_members_playground_key(
    gateway, serving, bob
):
    with member_session(gateway, bob) as session:
        response = chat(session, serving.model)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    got = events(response.content)
    assert got[-1] == "[DONE]"
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in got[:-1] if c.get("choices"))
    assert text.strip()
    assert any(c.get("usage") for c in got[:-1])  # the page shows the tokens accounted

    sent = upstream_stats(serving.upstream)["last_body"]
    assert sent["messages"][0] == {"role": "system", "content": "Be brief."}
    assert sent["max_tokens"] == 8 and sent["temperature"] == 0.2

    [row] = flushed_usage(serving.team)
    assert row.status == "completed" and row.endpoint == "chat" and row.stream
    assert row.api_key.name == "playground (bob)" and row.api_key.playground_user == bob
    assert row.completion_tokens > 0
    assert ApiKey.objects.filter(playground_user=bob).count() == 1


def test_it_answers_a_quota_refusal_with_the_gateways_message(gateway, serving, bob):
    serving.team.rpm_limit = 1
    serving.team.save()
    with member_session(gateway, bob) as session:
        assert chat(session, serving.model).status_code == 200
        refused = chat(session, serving.model)
    assert refused.status_code == 429
    assert refused.headers["content-type"] == "application/json"
    error = refused.json()["error"]
    assert error["type"] == "rate_limit_error" and "per minute" in error["message"]


def test_it_answers_a_model_without_a_replica_with_the_gateways_503(gateway, serving, bob):
    from portal.registry.services import model_version_create
    from tests.helpers.samples import bundled_config

    name = f"idle-{uuid.uuid4().hex[:8]}"
    idle = model_version_create(name=name, config=bundled_config("llama-2-7b-chat-hf"))
    with member_session(gateway, bob) as session:
        response = chat(session, idle.name)
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "no_replica"
    assert f"No replica of `{idle.name}` is serving." == response.json()["error"]["message"]


@pytest.mark.slow  # waits out a real timeout or a simulated acceptance
def test_it_answers_an_upstream_timeout_with_the_gateways_504(gateway, serving, bob):
    with member_session(gateway, bob) as session:
        # past the gateway's first-token timeout
        response = chat(session, serving.model, content=NO_FIRST_TOKEN_IN_TIME)
    assert response.status_code == 504
    assert response.json()["error"]["code"] == "upstream_timeout"
    [row] = flushed_usage(serving.team)
    assert row.status == "timeout" and row.api_key.playground_user == bob


def test_it_refuses_a_revoked_playground_key_like_any_revoked_key(gateway, serving, bob):
    from portal.playground.services import playground_key_for
    from portal.teams.services import api_key_revoke

    api_key_revoke(api_key=playground_key_for(team=serving.team, user=bob))
    with member_session(gateway, bob) as session:
        response = chat(session, serving.model)
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "revoked_api_key"


def test_it_streams_tokens_as_they_come_and_a_member_who_leaves_cancels_the_request(gateway, serving, bob):
    body = {
        "model": serving.model,
        "messages": [{"role": "user", "content": "FAKE chunks=40 interval=100"}],
        "max_tokens": 8,
        "temperature": 0,
    }
    with (
        member_session(gateway, bob) as session,
        session.stream("POST", "/teams/search/playground/chat", json=body) as response,
    ):
        assert response.status_code == 200
        chunks = response.iter_raw()  # kept: a dropped iterator closes the connection
        first = next(chunks)
        assert b'"delta"' in first
        # The first token is here while upstream is still generating: not buffered on the way.
        assert upstream_stats(serving.upstream)["in_flight"] == 1
    [row] = flushed_usage(serving.team)
    assert row.status == "client_cancelled"
    # The gateway dropped upstream too.
    wait_until(
        lambda: not upstream_stats(serving.upstream)["in_flight"], timeout_s=10, what="upstream dropped"
    )
