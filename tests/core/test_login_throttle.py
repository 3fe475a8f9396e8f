"""Password guessing is throttled per client address (never per username alone, which would let anyone
lock any account out): the login form and the API's Basic auth."""

from __future__ import annotations

import base64

import pytest
from django.conf import settings
from django.test import Client
from django.urls import reverse
from rest_framework.test import APIClient

pytestmark = pytest.mark.django_db

NODES = "/api/v1/nodes/"
WRONG = (401, 403)  # 403: session auth comes first, so DRF sends no WWW-Authenticate challenge


def basic(username: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{username}:{password}".encode()).decode()


def api_get(username: str, password: str, address: str = "10.0.0.1"):
    return APIClient().get(NODES, HTTP_AUTHORIZATION=basic(username, password), REMOTE_ADDR=address)


def test_it_answers_basic_auth_normally_below_the_limit(alice):
    for _ in range(settings.AXES_FAILURE_LIMIT - 1):
        assert api_get("alice", "wrong").status_code in WRONG
    assert api_get("alice", "alice-password").status_code == 200


def test_it_locks_the_address_that_guessed_and_no_other_out_of_basic_auth(alice):
    # A stranger's guesses at a staff account lock the stranger's address, not the account.
    for i in range(settings.AXES_FAILURE_LIMIT - 1):
        assert api_get("alice", f"guess-{i}", address="10.0.1.1").status_code in WRONG
    # The guess that reaches the limit is answered with the lockout, and so is the right password
    # from that address.
    assert api_get("alice", "one-more", address="10.0.1.1").status_code == 429
    refused = api_get("alice", "alice-password", address="10.0.1.1")
    assert refused.status_code == 429
    assert "Too many failed logins" in refused.json()["detail"]
    assert int(refused["Retry-After"]) > 0
    # alice, from an address that has not failed, is let in.
    assert api_get("alice", "alice-password", address="10.0.2.1").status_code == 200


def test_guesses_spread_over_many_addresses_never_lock_the_account(alice):
    for i in range(3 * settings.AXES_FAILURE_LIMIT):
        assert api_get("alice", f"guess-{i}", address=f"10.0.6.{i}").status_code in WRONG
    assert api_get("alice", "alice-password", address="10.0.7.1").status_code == 200


def test_a_forwarded_for_header_does_not_change_the_address_without_a_trusted_proxy(alice):
    # A new X-Forwarded-For on every guess would otherwise be a new address every time.
    for i in range(settings.AXES_FAILURE_LIMIT):
        response = APIClient().get(
            NODES, HTTP_AUTHORIZATION=basic("alice", f"guess-{i}"), REMOTE_ADDR="10.0.8.1",
            HTTP_X_FORWARDED_FOR=f"192.0.2.{i}",
        )  # fmt: skip
        assert response.status_code in (*WRONG, 429)
    assert api_get("alice", "alice-password", address="10.0.8.1").status_code == 429


def test_behind_a_trusted_proxy_each_client_address_is_counted_on_its_own(alice, settings):
    settings.TRUSTED_PROXY_COUNT = 1
    proxy = "10.0.9.1"

    def through_proxy(password: str, client: str, claimed: str = ""):
        forwarded = f"{claimed}, {client}" if claimed else client
        return APIClient().get(
            NODES, HTTP_AUTHORIZATION=basic("alice", password), REMOTE_ADDR=proxy,
            HTTP_X_FORWARDED_FOR=forwarded,
        )  # fmt: skip

    # What a client writes to the left of the proxy's entry is ignored: one client, one count.
    for i in range(settings.AXES_FAILURE_LIMIT):
        guess = through_proxy(f"guess-{i}", "198.51.100.7", claimed=f"192.0.2.{i}")
        assert guess.status_code in (*WRONG, 429)
    assert through_proxy("alice-password", "198.51.100.7").status_code == 429
    # Another client behind the same proxy is not affected.
    assert through_proxy("alice-password", "198.51.100.8").status_code == 200


def test_it_locks_an_address_out_of_basic_auth_after_guesses_at_many_usernames(alice):
    for i in range(settings.AXES_FAILURE_LIMIT - 1):
        assert api_get(f"user-{i}", "guess", address="10.0.3.1").status_code in WRONG
    assert api_get("user-last", "guess", address="10.0.3.1").status_code == 429
    assert api_get("alice", "alice-password", address="10.0.3.1").status_code == 429
    # Another address is not affected.
    assert api_get("alice", "alice-password", address="10.0.3.2").status_code == 200


def test_it_locks_the_guessing_address_out_of_the_login_form_and_lets_alice_in_from_another(alice):
    client = Client(REMOTE_ADDR="10.0.4.1")
    for i in range(settings.AXES_FAILURE_LIMIT):
        response = client.post(reverse("login"), {"username": "alice", "password": f"guess-{i}"})
        assert response.status_code in (200, 429)
    refused = client.post(reverse("login"), {"username": "alice", "password": "alice-password"})
    assert refused.status_code == 429
    assert "_auth_user_id" not in refused.wsgi_request.session
    elsewhere = Client(REMOTE_ADDR="10.0.4.2").post(
        reverse("login"), {"username": "alice", "password": "alice-password"}
    )
    assert elsewhere.status_code == 302
    assert "_auth_user_id" in elsewhere.wsgi_request.session


def test_a_body_that_cannot_be_parsed_is_refused_whatever_the_password(alice):
    # axes reads the body when it records a failure, and a parse error there skips the count: if the
    # right password got another answer than a wrong one (a GET reads no body), guesses would be free.
    def guess(password: str):
        return APIClient().generic(
            "GET", NODES, "{", content_type="application/json",
            HTTP_AUTHORIZATION=basic("alice", password), REMOTE_ADDR="10.0.5.1",
        )  # fmt: skip

    wrong, right = guess("wrong"), guess("alice-password")
    assert wrong.status_code == right.status_code == 400
    assert wrong.json() == right.json()
