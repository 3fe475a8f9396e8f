"""A JSON body nested too deeply to parse is a 400 wherever a body is parsed, never a 500 (a
RecursionError, which is not the ValueError parsers catch), before login as after."""

from __future__ import annotations

import base64

import pytest
from django.test import Client

pytestmark = [pytest.mark.django_db]

# 5,000 `[`: deeper than Python's parser follows. The `\u` sends it through the unstorable-text
# check's parse too (it looks only at bodies with escapes).
DEEP = ["[" * 5000, "[" * 5000 + '"\\u0041"', '{"a": ' * 400 + '"\\ud800"' + "}" * 400]


def basic(username: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{username}:{password}".encode()).decode()


@pytest.mark.parametrize("body", DEEP)
@pytest.mark.parametrize("url", ["/accounts/login/", "/api/v1/plan/"])
def test_an_anonymous_deep_body_is_never_a_500(url, body):
    response = Client().post(url, body, content_type="application/json")
    # 400 where it is parsed; the login form reads only form bodies (200: the form again), and
    # the API refuses an anonymous write unread (403).
    assert response.status_code in (200, 400, 403), response.content
    if "\\u" in body:
        assert response.status_code == 400 and b"nested too deeply" in response.content


@pytest.mark.parametrize("body", DEEP)
@pytest.mark.parametrize("url", ["/api/v1/plan/", "/api/v1/teams/"])
def test_a_deep_body_with_credentials_is_a_400(alice, url, body):
    response = Client().post(
        url, body, content_type="application/json", HTTP_AUTHORIZATION=basic("alice", "alice-password")
    )
    assert response.status_code == 400, response.content
    assert b"nested too deeply" in response.content


@pytest.mark.parametrize("body", DEEP)
def test_a_signed_in_members_deep_body_is_a_400(bob, body):
    client = Client()
    client.force_login(bob)
    response = client.post("/api/v1/plan/", body, content_type="application/json")
    assert response.status_code == 400, response.content
