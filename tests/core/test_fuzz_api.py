"""The REST API, fuzzed from its own OpenAPI schema (/api/schema/) with schemathesis.

Every operation gets generated requests (valid and invalid) as staff (who may
write) and as a team member (who may only read): none may answer 5xx, and a
documented answer must match its schema. Hypothesis is derandomized (the same
examples every run) and bounded, so CI runs the same fuzz in seconds.
"""

from __future__ import annotations

import base64

import pytest
import schemathesis

from tests.fuzz import CHECKS, fuzz_schema

pytestmark = [pytest.mark.django_db]

EXAMPLES = 10


def _basic(username: str, password: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{username}:{password}".encode()).decode()}


@pytest.fixture
def api_schema(alice, bob, team, dgx, llama7b, profile_tp8, settings):
    from django.core import signals
    from django.db import close_old_connections

    from portal.wsgi import application

    settings.ALLOWED_HOSTS = ["*"]
    # In-process WSGI calls must not close the test's connection (Django's test client does the same).
    signals.request_started.disconnect(close_old_connections)
    signals.request_finished.disconnect(close_old_connections)
    yield schemathesis.openapi.from_wsgi("/api/schema/", application)
    signals.request_started.connect(close_old_connections)
    signals.request_finished.connect(close_old_connections)


@pytest.mark.parametrize("user", ["alice", "bob"])
def test_the_api_never_fails(api_schema, user):
    headers = _basic(user, f"{user}-password")
    failures = fuzz_schema(
        api_schema, lambda case: case.call_and_validate(headers=headers, checks=CHECKS), examples=EXAMPLES
    )
    assert not failures, "\n\n".join(failures)
