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

from tests.helpers import builders
from tests.helpers.fuzz import CHECKS, fuzz_schema
from tests.helpers.gateway import Setup, chat_body, upstream_stats, wait_for_slots_free

pytestmark = [pytest.mark.django_db(transaction=True)]

SCHEMA = Path(__file__).resolve().parents[2] / "portal" / "gateway" / "openapi.json"
EXAMPLES = 40


def test_the_gateway_serves_its_openapi_description(gateway):
    response = httpx.get(f"{gateway.url}/v1/openapi.json")
    assert response.status_code == 200
    assert response.json() == json.loads(SCHEMA.read_text())


def _fixed_setup(team, node, upstream: str, name: str) -> Setup:
    """Like conftest.make_setup, but with a fixed model name: the schema's `model` enum is part of
    what Hypothesis draws from, so a fixed name keeps the fuzz the same on every run."""
    from portal.registry.services import model_version_create
    from portal.teams.services import api_key_create
    from tests.helpers.samples import bundled_config

    version = model_version_create(name=name, config=bundled_config("llama-2-7b-chat-hf"))
    profile = builders.profile(name=f"p-{name}", model_version=version)
    deployment = builders.deployment(
        name=f"d-{name}", team=team, model_version=version, profile=profile, node=node,
        desired_state="running", state="serving", endpoint_url=upstream,
    )  # fmt: skip
    key, token = api_key_create(team=team, name="fuzz", allowed_models=[name])
    return Setup(team, key, token, name, deployment, upstream)


@pytest.mark.slow  # fuzzing: not in make test-fast
@pytest.mark.parametrize("scoped", [True, False], ids=["key-for-the-model", "key-for-any-model"])
def test_the_gateway_never_fails(gateway, team, cpu_node, fake_upstream, gw_redis, scoped):
    # Short answers keep the fuzz quick (the fake upstream sends one chunk per token, 5 ms apart).
    team.max_tokens_clamp = 4
    team.save()
    setup = _fixed_setup(team, cpu_node, fake_upstream, f"fuzz-{'scoped' if scoped else 'any'}")
    document = json.loads(SCHEMA.read_text())
    # Valid cases name the served model, so they reach the upstream; invalid ones still vary it.
    for path in ("/v1/chat/completions", "/v1/completions"):
        request = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        request["properties"]["model"] = {"type": "string", "enum": [setup.model]}
    schema = schemathesis.openapi.from_dict(document)

    headers = setup.headers
    if not scoped:  # a key for any model: other model names reach the route lookup
        from portal.teams.services import api_key_create

        headers = {"Authorization": f"Bearer {api_key_create(team=team)[1]}"}
    statuses: list[int] = []

    def call(case):
        response = case.call_and_validate(base_url=gateway.url, headers=headers, checks=CHECKS)
        statuses.append(response.status_code)

    failures = fuzz_schema(schema, call, examples=EXAMPLES)
    assert not failures, "\n\n".join(failures)
    assert 200 in statuses and 400 in statuses  # the fuzz reached the upstream and the validation
    assert not [s for s in statuses if s >= 500]
    assert not any(wait_for_slots_free(gw_redis, setup).values())


def test_both_token_limits_are_checked_and_clamped(gateway, serving):
    """Found by fuzzing: with max_completion_tokens given, max_tokens went upstream unchecked (a string
    made the fake upstream fail: a 502) and unclamped."""
    url, headers = f"{gateway.url}/v1/chat/completions", serving.headers
    both = chat_body(serving.model, max_completion_tokens=2, max_tokens="many")
    response = httpx.post(url, headers=headers, json=both)
    assert response.status_code == 400 and response.json()["error"]["param"] == "max_tokens"
    response = httpx.post(url, headers=headers, json={**both, "max_tokens": 100_000})
    assert response.status_code == 200
    sent = upstream_stats(serving.upstream)["last_body"]
    assert (sent["max_completion_tokens"], sent["max_tokens"]) == (2, 1024)


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
