"""The new key comes with its base URL and ready curl and Python calls."""

from __future__ import annotations

import html
import re

import pytest
from django.test import Client
from django.urls import reverse

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("gateway_redis_db")]


def create_key(user, **fields) -> tuple[str, str]:
    client = Client()
    client.force_login(user)
    response = client.post(reverse("teams:keys", args=["search"]), {"name": "nb", **fields})
    assert response.status_code == 200
    return response.context["new_token"], response.content.decode()


def snippet(page: str, name: str) -> str:
    return html.unescape(re.search(rf'<pre id="snippet-{name}">(.*?)</pre>', page, re.S).group(1))


def test_it_shows_the_base_url_and_a_curl_call_with_the_new_key_and_its_model(bob, team, models_m1_m2):
    token, page = create_key(bob, models="m1, m2")
    assert '<code id="base-url">http://testserver/v1</code>' in page
    curl = snippet(page, "curl")
    assert f'curl http://testserver/v1/chat/completions -H "Authorization: Bearer {token}"' in curl
    assert '"model": "m1"' in curl


def test_it_shows_an_openai_client_call_that_is_valid_python(bob, team):
    token, page = create_key(bob)
    python = snippet(page, "python")
    compile(python, "snippet.py", "exec")
    assert f'OpenAI(base_url="http://testserver/v1", api_key="{token}")' in python
    assert 'model="MODEL"' in python and "Replace <code>MODEL</code>" in page


def test_it_shows_no_snippets_once_the_key_is_gone_from_the_page(bob, team):
    create_key(bob)
    client = Client()
    client.force_login(bob)
    assert "snippet-curl" not in client.get(reverse("teams:keys", args=["search"])).content.decode()


def test_it_shows_a_model_the_key_can_call_when_the_key_has_no_list(bob, team, llama7b):
    _, page = create_key(bob)
    assert '"model": "llama-2-7b-chat-hf"' in snippet(page, "curl")
    assert 'model="MODEL"' not in snippet(page, "python")


def test_it_leaves_acceptance_reference_models_out_of_the_key_forms_models(bob, team, llama7b):
    from portal.inventory.models import ACCEPTANCE_SOURCE_PREFIX
    from portal.teams.selectors import model_names_for_team
    from tests.helpers import builders

    builders.model_version(
        "accept-tiny-fp16", config="llama-2-7b-chat-hf", source=f"{ACCEPTANCE_SOURCE_PREFIX} (tiny)"
    )
    assert model_names_for_team(team) == ["llama-2-7b-chat-hf"]
