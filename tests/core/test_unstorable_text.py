"""NUL characters and lone surrogates get a 400, wherever they are (found by fuzzing the API).

Before, each was a PostgreSQL error, i.e. a 500, as soon as it reached a lookup.
"""

from __future__ import annotations

import json

import pytest
from django.test import Client

from tests.helpers.clients import api_client

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize(
    "url",
    [
        "/api/v1/benchmark-runs/?deployment=%00",
        "/api/v1/nodes/a%00b/",
        "/api/v1/deployments/x%00/",
        "/api/v1/teams/a%00/",
        "/api/v1/model-versions/a%00/",
        "/api/v1/model-versions/?%00=1",
    ],
)
def test_the_api_refuses_a_nul_in_the_url(alice, url):
    response = api_client(alice).get(url)
    assert response.status_code == 400
    assert "NUL" in response.json()["detail"]


@pytest.mark.parametrize("text", ["llama\x00", "\ud800", "ok"])
def test_the_api_refuses_unstorable_text_in_a_json_body(alice, team, text):
    body = {"name": "adopted", "team": "search", "model_version": text, "url": "http://127.0.0.1:9/v1"}
    response = api_client(alice).post(
        "/api/v1/deployments/register-endpoint/",
        data=json.dumps(body),  # json.dumps escapes both as \u0000 and \ud800
        content_type="application/json",
    )
    assert response.status_code == 400
    if text == "ok":  # an ordinary unknown name is still the serializer's own answer
        assert "model_version" in response.json()


@pytest.mark.parametrize(
    "method, url",
    [
        ("post", "/teams/search/keys/a%00/revoke/"),
        ("get", "/models/a%00/"),
        ("get", "/nodes/a%00/"),
        ("get", "/benchmarks/?deployment=%00"),
    ],
)
def test_the_pages_refuse_a_nul_in_the_url(bob, team, method, url):
    client = Client()
    client.force_login(bob)
    response = getattr(client, method)(url)
    assert response.status_code == 400


def test_the_pages_refuse_a_nul_in_a_form(bob, team):
    client = Client()
    client.force_login(bob)
    response = client.post("/teams/search/keys/", {"name": "ci\x00"})
    assert response.status_code == 400
