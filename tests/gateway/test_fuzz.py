"""The gateway, fuzzed with schemathesis against its hand-written OpenAPI description.

uvicorn serves the gateway in front of the fake upstream; every operation gets
derandomized valid and invalid requests with a valid key. No 5xx may come back
except the documented upstream outcomes (502/503/504, which the fake upstream does
not cause here, so none is expected), and every documented answer must match its
schema and content type.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import schemathesis

from tests.fuzz import CHECKS, fuzz_schema

from .conftest import wait_for_slots_free

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.integration]

SCHEMA = Path(__file__).resolve().parents[2] / "portal" / "gateway" / "openapi.json"
EXAMPLES = 40


def test_the_gateway_serves_its_openapi_description(gateway):
    response = httpx.get(f"{gateway.url}/v1/openapi.json")
    assert response.status_code == 200
    assert response.json() == json.loads(SCHEMA.read_text())


@pytest.mark.parametrize("scoped", [True, False], ids=["key-for-the-model", "key-for-any-model"])
def test_the_gateway_never_fails(gateway, serving, gw_redis, scoped):
    # Short answers keep the fuzz quick (the fake upstream sends one chunk per token, 5 ms apart).
    serving.team.max_tokens_clamp = 4
    serving.team.save()
    document = json.loads(SCHEMA.read_text())
    # Valid cases name the served model, so they reach the upstream; invalid ones still vary it.
    for path in ("/v1/chat/completions", "/v1/completions"):
        request = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        request["properties"]["model"] = {"type": "string", "enum": [serving.model]}
    schema = schemathesis.openapi.from_dict(document)

    headers = serving.headers
    if not scoped:  # a key for any model: other model names reach the route lookup
        from portal.teams.services import api_key_create

        headers = {"Authorization": f"Bearer {api_key_create(team=serving.team)[1]}"}
    statuses: list[int] = []

    def call(case):
        response = case.call_and_validate(base_url=gateway.url, headers=headers, checks=CHECKS)
        statuses.append(response.status_code)

    failures = fuzz_schema(schema, call, examples=EXAMPLES)
    assert not failures, "\n\n".join(failures)
    assert 200 in statuses and 400 in statuses  # the fuzz reached the upstream and the validation
    assert not [s for s in statuses if s >= 500]
    assert not any(wait_for_slots_free(gw_redis, serving).values())


@pytest.mark.parametrize("model", ["llama\x00", "\ud800"])
def test_a_model_name_no_column_can_hold_is_refused(gateway, serving, gw_redis, model):
    """Found by fuzzing: such a name was a database error (500) in the route lookup, and its usage
    record would have failed every later usage flush."""
    from portal.teams.services import api_key_create

    _key, token = api_key_create(team=serving.team)  # any model: the name reaches the route lookup
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}]})  # \u escapes
    response = httpx.post(
        f"{gateway.url}/v1/chat/completions",
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        content=body,
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "model"
