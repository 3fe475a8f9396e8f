"""An unknown path under /v1/ is the gateway's OpenAI-shaped 404 with a hint, not an HTML page."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.django_db


def test_it_answers_an_unknown_v1_path_with_openai_json_and_the_close_endpoint(client):
    response = client.post("/v1/chat/completion", data="{}", content_type="application/json")
    assert response.status_code == 404 and response["Content-Type"] == "application/json"
    error = response.json()["error"]
    assert error["type"] == "not_found_error" and error["code"] == "unknown_url"
    assert "Did you mean /v1/chat/completions?" in error["message"]


def test_it_names_the_served_endpoints_when_nothing_is_close(client):
    error = client.get("/v1/embeddings/xyz").json()["error"]
    assert "Did you mean" not in error["message"]
    assert "/v1/chat/completions, /v1/completions, /v1/models" in error["message"]


def test_the_bare_v1_prefix_answers_json_too(client):
    response = client.get("/v1")
    assert response.status_code == 404 and response.json()["error"]["code"] == "unknown_url"


def test_it_still_serves_the_real_endpoints(client):
    assert client.get("/v1/models").json()["error"]["code"] != "unknown_url"
