"""Bad input gets a clear OpenAI-shaped error, never a 500; every slot is released."""

from __future__ import annotations

import uuid

import httpx
import pytest

from tests.helpers.gateway import NO_FIRST_TOKEN_IN_TIME, chat_body, wait_for_slots_free

pytestmark = [pytest.mark.django_db(transaction=True)]


def post(gateway, setup, body=None, *, content=None, headers=None, path="/v1/chat/completions"):
    return httpx.post(
        f"{gateway.url}{path}",
        headers={**setup.headers, **(headers or {})},
        json=body if content is None else None,
        content=content,
        timeout=30,
    )


def assert_error(response, status: int, code: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "code"}
    assert error["code"] == code
    return error


def test_it_refuses_a_missing_key(gateway, serving):
    response = httpx.post(f"{gateway.url}/v1/chat/completions", json=chat_body(serving.model))
    assert_error(response, 401, "missing_api_key")


def test_it_refuses_a_wrong_key_without_echoing_it(gateway, serving):
    wrong = serving.token[:-4] + "AAAA"
    response = httpx.post(
        f"{gateway.url}/v1/chat/completions",
        headers={"Authorization": f"Bearer {wrong}"},
        json=chat_body(serving.model),
    )
    error = assert_error(response, 401, "invalid_api_key")
    assert wrong not in error["message"]


def test_it_slows_down_an_address_that_keeps_sending_wrong_keys_but_serves_good_ones(gateway, serving):
    from django.conf import settings

    assert post(gateway, serving, chat_body(serving.model, max_tokens=2)).status_code == 200
    limit = settings.GATEWAY_AUTH_FAILURES_PER_MINUTE
    for _ in range(limit):
        guess = {"Authorization": f"Bearer sk-{uuid.uuid4().hex[:8]}.{uuid.uuid4().hex}"}
        assert_error(post(gateway, serving, chat_body(serving.model), headers=guess), 401, "invalid_api_key")
    guess = {"Authorization": f"Bearer sk-{uuid.uuid4().hex[:8]}.{uuid.uuid4().hex}"}
    refused = post(gateway, serving, chat_body(serving.model), headers=guess)
    assert_error(refused, 429, "too_many_auth_failures")
    assert 1 <= int(refused.headers["retry-after"]) <= 60
    # A key this process already knows to be good still works from the same address.
    assert post(gateway, serving, chat_body(serving.model, max_tokens=2)).status_code == 200


def test_it_refuses_a_malformed_key(gateway, serving):
    response = httpx.get(f"{gateway.url}/v1/models", headers={"Authorization": "Bearer not-a-key"})
    assert_error(response, 401, "invalid_api_key")


def test_it_refuses_malformed_json(gateway, serving):
    assert_error(post(gateway, serving, content=b"{not json", headers={"content-type": "application/json"}),
                 400, "invalid_json")  # fmt: skip


def test_it_refuses_a_body_that_is_not_an_object(gateway, serving):
    assert_error(post(gateway, serving, [1, 2]), 400, "invalid_json")


@pytest.mark.parametrize("max_tokens", [-1, 0, "many", 1.5, True])
def test_it_refuses_a_bad_max_tokens(gateway, serving, max_tokens):
    error = assert_error(
        post(gateway, serving, chat_body(serving.model, max_tokens=max_tokens)), 400, "invalid_value"
    )
    assert error["param"] == "max_tokens"


def test_it_refuses_unknown_fields(gateway, serving):
    error = assert_error(
        post(gateway, serving, chat_body(serving.model, frobnicate=1)), 400, "unknown_parameter"
    )
    assert "frobnicate" in error["message"]


def test_it_refuses_missing_messages(gateway, serving):
    assert_error(post(gateway, serving, {"model": serving.model}), 400, "invalid_value")


def test_it_refuses_a_body_over_the_limit(gateway, serving):
    huge = "x" * (1024 * 1024 + 10)
    assert_error(post(gateway, serving, chat_body(serving.model, huge)), 413, "request_too_large")


def test_it_refuses_a_model_the_key_may_not_use(gateway, serving):
    assert_error(post(gateway, serving, chat_body("some-other-model")), 403, "model_not_allowed")


def test_it_answers_404_for_an_unknown_model(gateway, team, serving):
    from portal.teams.services import api_key_create

    _key, token = api_key_create(team=team)  # may use any model
    response = httpx.post(
        f"{gateway.url}/v1/chat/completions",
        headers={"Authorization": f"Bearer {token}"},
        json=chat_body("nope"),
    )
    error = assert_error(response, 404, "model_not_found")
    assert "Did you mean" not in error["message"]  # nothing served is close to "nope"


def test_the_404_for_a_mistyped_model_names_the_close_one_this_key_can_call(gateway, team, serving):
    from portal.teams.services import api_key_create

    # As `llama-2-7b-chat` for `llama-2-7b-chat-hf`. (A key with no model list is offered the models
    # its team reaches, from the gateway's cached list of served models: the same message.)
    typo = serving.model + "-hf"
    _key, token = api_key_create(team=team, allowed_models=[serving.model, typo])
    headers = {"Authorization": f"Bearer {token}"}
    response = httpx.post(f"{gateway.url}/v1/chat/completions", headers=headers, json=chat_body(typo))
    error = assert_error(response, 404, "model_not_found")
    assert error["message"] == f"The model `{typo}` does not exist. Did you mean `{serving.model}`?"
    # A key limited to some models is told the close one among them.
    response = post(gateway, serving, chat_body(serving.model[:-1]))
    error = assert_error(response, 403, "model_not_allowed")
    assert error["message"].endswith(f"Did you mean `{serving.model}`?")


def test_it_answers_503_when_no_replica_serves_the_model(gateway, serving):
    serving.deployment.state = "draining"
    serving.deployment.save()
    # Route caches last GATEWAY_CACHE_S; this model was never routed before, so nothing is cached.
    response = post(gateway, serving, chat_body(serving.model))
    assert_error(response, 503, "no_replica")
    assert response.headers["retry-after"]


def test_it_records_no_replica_as_an_outage_not_a_refusal(gateway, serving, gw_redis):
    """5,161 `503 no_replica` of a GPU move once sat beside 7 quota refusals as "rejected"."""
    from portal.teams.models import Usage
    from portal.teams.services import usage_flush

    serving.deployment.state = "draining"
    serving.deployment.save()
    assert_error(post(gateway, serving, chat_body(serving.model)), 503, "no_replica")
    usage_flush()
    recorded = Usage.objects.filter(team=serving.team).values_list("status", "http_status", "error_code")
    assert list(recorded) == [("unavailable", 503, "no_replica")]


def test_it_refuses_get_on_a_post_endpoint(gateway, serving):
    response = httpx.get(f"{gateway.url}/v1/chat/completions", headers=serving.headers)
    assert_error(response, 405, "method_not_allowed")


def test_it_passes_upstreams_own_4xx_through_and_releases_the_slot(gateway, serving, gw_redis):
    response = post(gateway, serving, chat_body(serving.model, "FAKE status=400"))
    assert response.status_code == 400
    assert response.json()["error"]["message"] == "fake 400"
    assert not any(wait_for_slots_free(gw_redis, serving).values())


def test_it_answers_502_for_an_upstream_5xx_and_releases_the_slot(gateway, serving, gw_redis):
    response = post(gateway, serving, chat_body(serving.model, "FAKE status=500", stream=True))
    assert_error(response, 502, "upstream_error")
    assert not any(wait_for_slots_free(gw_redis, serving).values())


@pytest.mark.slow  # waits out a real timeout or a simulated acceptance
def test_it_answers_504_when_upstream_sends_no_first_token_in_time(gateway, serving, gw_redis):
    response = post(gateway, serving, chat_body(serving.model, NO_FIRST_TOKEN_IN_TIME, stream=True))
    assert_error(response, 504, "upstream_timeout")
    assert not any(wait_for_slots_free(gw_redis, serving).values())


def test_it_sends_one_error_event_when_upstream_dies_mid_stream(gateway, serving, gw_redis):
    response = post(gateway, serving, chat_body(serving.model, "FAKE die_after=3", stream=True))
    assert response.status_code == 200
    events = [e for e in response.content.split(b"\n\n") if e]
    assert len(events) == 4
    assert events[-1].startswith(b'data: {"error"')
    assert not any(wait_for_slots_free(gw_redis, serving).values())


def test_it_refuses_a_host_that_allowed_hosts_does_not_list(gateway, serving):
    response = post(gateway, serving, chat_body(serving.model), headers={"Host": "evil.example"})
    assert_error(response, 400, "invalid_host")


@pytest.mark.parametrize("body", [b"[" * 5000, b'{"model": "m", "messages": ' + b"[" * 5000])
def test_it_refuses_json_nested_too_deeply_as_a_client_error(gateway, serving, body):
    """Was a 500 recorded as `upstream_error` (a RecursionError), which a member could use to trip
    the upstream-error alert."""
    from portal.teams.models import Usage
    from portal.teams.services import usage_flush

    response = post(gateway, serving, content=body, headers={"content-type": "application/json"})
    error = assert_error(response, 400, "invalid_json")
    assert "nested too deeply" in error["message"]
    usage_flush()
    recorded = Usage.objects.filter(team=serving.team).values_list("status", "http_status", "error_code")
    assert list(recorded) == [("rejected", 400, "invalid_json")]
