"""The playground page and its chat endpoint's checks, through Django's test client."""

from __future__ import annotations

import json

import pytest
from django.test import Client

from portal.teams.models import ApiKey
from tests.helpers import builders

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("gateway_redis_db")]


def chat_url(slug: str = "search") -> str:
    return f"/teams/{slug}/playground/chat"


def good(**changes) -> dict:
    body = {
        "model": "llama-2-7b-chat-hf",
        "messages": [{"role": "user", "content": "Hello"}],
        "system": "Be brief.",
        "max_tokens": 16,
        "temperature": 0.5,
    }
    return {**body, **changes}


@pytest.fixture
def served(team, llama7b, profile_tp1, cpu_node):
    return builders.deployment(
        name="chat", team=team, model_version=llama7b, profile=profile_tp1, node=cpu_node,
        desired_state="running", state="serving", endpoint_url="http://127.0.0.1:9", concurrency_cap=4,
    )  # fmt: skip


def test_it_shows_a_member_the_models_their_team_can_call_and_no_key(client: Client, bob, served):
    client.force_login(bob)
    response = client.get("/teams/search/playground/")
    assert response.status_code == 200
    page = response.content.decode()
    assert '<option value="llama-2-7b-chat-hf" data-max-tokens="1024"' in page
    assert 'max="1024"' in page  # the team's max_tokens clamp bounds the field (the context is 4096)
    assert "sk-" not in page
    assert "Copy as code" in page
    assert not ApiKey.objects.exists()  # the key is made on the first chat, not by looking


def test_the_max_tokens_hint_is_the_models_bound_when_its_context_is_smaller_than_the_clamp(
    client: Client, bob, served
):
    served.profile.max_model_len = 512
    served.profile.save()
    client.force_login(bob)
    page = client.get("/teams/search/playground/").content.decode()
    assert 'data-max-tokens="512" data-context-bound="1"' in page
    assert 'max="512"' in page and "1 to 512, less the prompt (the model's context)" in page
    assert "1 to 1024" not in page


def test_it_says_so_when_no_model_the_team_may_call_is_serving(client: Client, bob, team):
    client.force_login(bob)
    response = client.get("/teams/search/playground/")
    assert "No model your team may call is serving right now." in response.content.decode()


def test_it_links_the_playground_from_the_team_pages(client: Client, bob, team):
    client.force_login(bob)
    for path in ("/teams/search/", "/teams/search/keys/", "/teams/search/usage/", "/"):
        assert 'href="/teams/search/playground/"' in client.get(path).content.decode(), path


def test_it_keeps_other_users_out(client: Client, charlie, alice, team):
    assert client.get("/teams/search/playground/").status_code == 302  # to the login page
    assert client.post(chat_url(), good(), content_type="application/json").status_code == 302
    for user in (charlie, alice):  # staff too: the requests would be billed to a team they are not in
        client.force_login(user)
        assert client.get("/teams/search/playground/").status_code == 404
        assert client.post(chat_url(), good(), content_type="application/json").status_code == 404
    assert not ApiKey.objects.exists()


def test_it_refuses_a_chat_post_without_the_csrf_token(bob, team):
    client = Client(enforce_csrf_checks=True)
    client.force_login(bob)
    response = client.post(chat_url(), good(), content_type="application/json")
    assert response.status_code == 403
    assert not ApiKey.objects.exists()


def test_it_answers_get_on_the_chat_endpoint_with_405(client: Client, bob, team):
    client.force_login(bob)
    assert client.get(chat_url()).status_code == 405


@pytest.mark.parametrize(
    ("changes", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 1025}, "max_tokens"),
        ({"max_tokens": "16"}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": None}, "temperature"),
        ({"system": "x" * 4001}, "system"),
        ({"system": ["a"]}, "system"),
        ({"model": ""}, "model"),
        ({"model": "m" * 101}, "model"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": "x" * 8001}]}, "messages"),
        ({"messages": [{"role": "user", "content": "hi"}] * 51}, "messages"),
        ({"messages": [{"role": "system", "content": "hi"}]}, "messages"),
        ({"messages": [{"role": "user", "content": "hi", "name": "x"}]}, "messages"),
        ({"messages": [{"role": "assistant", "content": "hi"}]}, "messages"),
        ({"messages": [{"role": "user", "content": "   "}]}, "messages"),
        ({"stream": False}, "stream"),
    ],
)
def test_it_refuses_out_of_bounds_input_with_a_400_naming_the_field(
    client: Client, bob, team, changes, param
):
    client.force_login(bob)
    response = client.post(chat_url(), good(**changes), content_type="application/json")
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param
    assert error["message"]
    assert not ApiKey.objects.exists()


def test_it_refuses_a_body_that_is_not_json(client: Client, bob, team):
    client.force_login(bob)
    response = client.post(chat_url(), b"{nope", content_type="application/json")
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_json"


def test_it_bounds_max_tokens_by_the_teams_clamp(client: Client, bob, team):
    team.max_tokens_clamp = 64
    team.save()
    client.force_login(bob)
    response = client.post(chat_url(), good(max_tokens=65), content_type="application/json")
    assert response.status_code == 400
    assert "from 1 to 64" in response.json()["error"]["message"]


def test_it_builds_a_streamed_chat_request_with_the_system_prompt_first():
    from portal.playground.payload import chat_body

    raw = json.dumps(good()).encode()
    body = json.loads(chat_body(raw, max_tokens_clamp=1024))
    assert body["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello"},
    ]
    assert body["stream"] is True and body["max_tokens"] == 16 and body["temperature"] == 0.5
    no_system = json.loads(chat_body(json.dumps(good(system="  ")).encode(), max_tokens_clamp=1024))
    assert [m["role"] for m in no_system["messages"]] == ["user"]


def test_it_makes_one_hidden_playground_key_per_member_and_team(bob, team, django_user_model):
    from portal.audit.models import AuditEvent
    from portal.playground.services import playground_key_for

    key = playground_key_for(team=team, user=bob)
    assert playground_key_for(team=team, user=bob).pk == key.pk
    assert key.name == "playground (bob)" and key.playground_user == bob and len(key.digest) == 64
    dana = django_user_model.objects.create_user("dana", password="dana-password")
    team.members.add(dana)
    assert playground_key_for(team=team, user=dana).pk != key.pk
    assert AuditEvent.objects.filter(action="api_key.create").count() == 2


def test_it_leaves_the_playground_key_out_of_the_key_lists(client: Client, bob, team):
    from portal.playground.services import playground_key_for
    from portal.teams.services import api_key_create

    hidden = playground_key_for(team=team, user=bob)
    shown, _token = api_key_create(team=team, name="notebook")
    client.force_login(bob)
    for path in ("/teams/search/keys/", "/"):
        page = client.get(path).content.decode()
        assert f"sk-{shown.prefix}" in page and f"sk-{hidden.prefix}" not in page, path
    assert client.get("/teams/search/").context["active_keys"] == 1
    # Nor can it be revoked from the team's page (staff revoke it in the admin).
    assert client.post(f"/teams/search/keys/{hidden.prefix}/revoke/").status_code == 404


def test_it_shows_todays_usage_per_key_with_the_playground_keys_name(client: Client, bob, team):
    import uuid

    from django.utils import timezone

    from portal.playground.services import playground_key_for
    from portal.teams.models import Usage
    from portal.teams.services import api_key_create

    playground = playground_key_for(team=team, user=bob)
    notebook, _token = api_key_create(team=team, name="notebook")
    for key, tokens in [(playground, 30), (playground, 12), (notebook, 5)]:
        Usage.objects.create(
            request_id=uuid.uuid4(), created_at=timezone.now(), team=team, api_key=key, model="m",
            status="completed", http_status=200, prompt_tokens=tokens, completion_tokens=0, duration_ms=5,
        )  # fmt: skip
    client.force_login(bob)
    response = client.get("/teams/search/usage/")
    assert [(r["name"], r["requests"], r["tokens"]) for r in response.context["by_key"]] == [
        ("playground (bob)", 2, 42),
        ("notebook", 1, 5),
    ]
    assert "playground (bob)" in response.content.decode()


def test_it_says_a_generated_test_model_has_random_weights(client: Client, bob, team, cpu_node, served):
    tiny = builders.model_version("tiny-llama", source="make_tiny_model")
    profile = builders.profile(tiny, name="tiny-p")
    builders.deployment(
        name="tiny", team=team, model_version=tiny, profile=profile, node=cpu_node,
        desired_state="running", state="serving", endpoint_url="http://127.0.0.1:9",
    )  # fmt: skip
    client.force_login(bob)
    page = client.get("/teams/search/playground/").content.decode()
    assert "tiny-llama: random weights" in page and "gibberish" in page
    assert "llama-2-7b-chat-hf: random" not in page
