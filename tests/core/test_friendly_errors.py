"""Ordinary mistakes get the portal's own pages, not the framework's."""

from __future__ import annotations

from pathlib import Path

import pytest
from django.test import Client

pytestmark = pytest.mark.django_db


def test_it_says_the_session_expired_when_a_form_lost_its_csrf_token(alice):
    client = Client(enforce_csrf_checks=True)
    client.force_login(alice)
    response = client.post(
        "/nodes/new/", {"name": "dgx-v100-09"}, HTTP_REFERER="http://testserver/nodes/new/"
    )
    assert response.status_code == 403
    page = response.content.decode()
    assert "Your session expired" in page and "CSRF verification failed" not in page
    assert 'href="http://testserver/nodes/new/">Reload the page</a>' in page


def test_it_offers_to_log_in_again_when_the_session_is_gone():
    response = Client(enforce_csrf_checks=True).post("/accounts/login/", {"username": "x", "password": "y"})
    assert response.status_code == 403
    assert "Your session expired" in response.content.decode() and "log in" in response.content.decode()


def test_it_serves_a_favicon_instead_of_a_404(client):
    response = client.get("/favicon.ico")
    assert response.status_code == 301 and response["Location"].endswith("core/favicon.ico")
    from django.contrib.staticfiles import finders

    icon = finders.find("core/favicon.ico")
    assert icon and Path(icon).read_bytes()[:4] == b"\x00\x00\x01\x00"  # an ICO header
    assert finders.find("core/favicon.svg")
