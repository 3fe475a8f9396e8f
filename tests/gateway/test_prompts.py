"""What a request's prompt costs: every prompt of a batch, everything that becomes prompt text,
counted after the cheap limits and off the event loop; text that cannot be encoded is a 400."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from portal.core.redis.client import redis_keys
from portal.gateway.per_loop import PerLoop
from tests.helpers.gateway import chat_body, slots_in_use, upstream_reset, wait_for_slots_free
from tests.helpers.processes import run_async

pytestmark = [pytest.mark.django_db(transaction=True)]


def post(gateway, setup, body: dict, path: str = "/v1/completions") -> httpx.Response:
    return httpx.post(f"{gateway.url}{path}", headers=setup.headers, json=body, timeout=30)


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


# --- batched prompts -------------------------------------------------------------------------


def test_it_reserves_max_tokens_for_every_sequence_of_every_prompt(gateway, serving):
    serving.team.tpm_limit = 500
    serving.team.save()
    one = {"model": serving.model, "prompt": "a", "n": 2, "max_tokens": 100}
    assert post(gateway, serving, one).status_code == 200  # 1 × 2 × 100 fits in 500
    batch = {**one, "prompt": ["a", "b", "c"]}  # 3 × 2 × 100 = 600 does not
    error = error_of(post(gateway, serving, batch), 429)
    assert error["code"] == "tokens_exceed_quota"
    assert "max_tokens × n × prompts" in error["message"]


def test_it_counts_each_prompt_of_a_batch_against_the_deployment_cap(gateway, serving, gw_redis):
    serving.deployment.concurrency_cap = 4
    serving.deployment.save()
    upstream_reset(serving.upstream)
    body = {"model": serving.model, "prompt": ["FAKE chunks=60 interval=50", "b", "c"], "stream": True}
    inflight = redis_keys().inflight(serving.deployment.pk)
    with httpx.stream(
        "POST", f"{gateway.url}/v1/completions", headers=serving.headers, json=body, timeout=30
    ) as response:
        assert response.status_code == 200
        chunks = response.iter_raw()  # kept: a dropped iterator closes the connection
        next(chunks)  # streaming: its slots are held
        assert gw_redis.zcount(inflight, time.time() * 1000, "+inf") == 3
    assert not any(wait_for_slots_free(gw_redis, serving).values())


def test_it_counts_every_sequence_of_n_against_the_deployment_cap(gateway, serving, gw_redis):
    """A batch of 3 prompts with n=16 once held 3 slots: 48 sequences in the engine's batch."""
    serving.deployment.concurrency_cap = 6
    serving.deployment.save()
    upstream_reset(serving.upstream)
    body = {"model": serving.model, "prompt": ["FAKE chunks=60 interval=50", "b"], "n": 3, "stream": True}
    with httpx.stream(
        "POST", f"{gateway.url}/v1/completions", headers=serving.headers, json=body, timeout=30
    ) as response:
        assert response.status_code == 200
        chunks = response.iter_raw()  # kept: a dropped iterator closes the connection
        next(chunks)  # streaming: its slots are held
        assert slots_in_use(gw_redis, serving)["deployment"] == 6
    assert not any(wait_for_slots_free(gw_redis, serving).values())


def test_it_refuses_an_n_that_cannot_fit_the_deployment_cap_naming_n(gateway, serving):
    serving.deployment.concurrency_cap = 4
    serving.deployment.save()
    error = error_of(post(gateway, serving, {"model": serving.model, "prompt": ["a", "b"], "n": 3}), 400)
    assert error["param"] == "n" and "at most 2" in error["message"]


def test_it_refuses_a_best_of_that_cannot_fit_the_deployment_cap_naming_best_of(gateway, serving):
    serving.deployment.concurrency_cap = 4
    serving.deployment.save()
    error = error_of(post(gateway, serving, {"model": serving.model, "prompt": "a", "best_of": 5}), 400)
    assert error["param"] == "best_of" and "at most 4" in error["message"]


def test_it_refuses_more_prompts_than_the_limit_naming_the_field(gateway, serving, settings):
    from django.conf import settings as live

    too_many = {"model": serving.model, "prompt": ["a"] * (live.GATEWAY_MAX_PROMPTS + 1), "n": 16}
    error = error_of(post(gateway, serving, too_many), 400)
    assert error["param"] == "prompt"
    assert str(live.GATEWAY_MAX_PROMPTS) in error["message"]
    assert error_of(post(gateway, serving, {**too_many, "prompt": ["a"] * 1000}), 400)["param"] == "prompt"
    for bad in ([1, "a"], [[]], [{"text": "a"}]):
        refused = post(gateway, serving, {"model": serving.model, "prompt": bad})
        assert error_of(refused, 400)["param"] == "prompt"


# --- everything that becomes prompt text -------------------------------------------------------


def test_it_counts_a_large_tools_array_against_the_token_quota(gateway, serving):
    serving.team.tpm_limit = 2000
    serving.team.save()
    tool = {"type": "function", "function": {"name": "f", "description": "word " * 200, "parameters": {}}}
    small = chat_body(serving.model, "Hi", max_tokens=2)
    assert post(gateway, serving, {**small, "tools": [tool]}, "/v1/chat/completions").status_code == 200
    big = {**small, "tools": [tool] * 40}  # ~40 KB of definitions: ~10,000 tokens
    error = error_of(post(gateway, serving, big, "/v1/chat/completions"), 429)
    assert error["code"] == "tokens_exceed_quota"


# --- encoding ----------------------------------------------------------------------------------


def with_tokenizer(setup, tmp_path) -> None:
    from portal.registry.models import ModelVersion
    from tests.helpers.tokens import word_tokenizer

    word_tokenizer(tmp_path / "tokenizer.json")
    ModelVersion.objects.filter(name=setup.model).update(path=str(tmp_path))


def test_it_answers_400_for_a_lone_surrogate_in_a_message(gateway, serving, tmp_path):
    with_tokenizer(serving, tmp_path)
    body = json.dumps(chat_body(serving.model, "hello \ud800 world"))  # ensure_ascii: sent as \\ud800
    assert "\\ud800" in body
    response = httpx.post(
        f"{gateway.url}/v1/chat/completions",
        headers={**serving.headers, "content-type": "application/json"},
        content=body.encode(),
        timeout=30,
    )
    error = error_of(response, 400)
    assert error["param"] == "messages"
    assert "surrogate" in error["message"]
    # A surrogate pair (an emoji) is text, and is served.
    emoji = chat_body(serving.model, "hello \U0001f600", max_tokens=2)
    assert post(gateway, serving, emoji, "/v1/chat/completions").status_code == 200


# --- the cheap limits first, the count off the event loop --------------------------------------


def test_it_checks_the_rate_before_counting_a_large_prompt_and_counts_it_off_the_loop(serving, monkeypatch):
    """In process (the view itself), to see where and whether the count ran."""
    import threading

    from asgiref.sync import sync_to_async
    from django.db import connections
    from django.test import AsyncRequestFactory

    from portal.gateway import tokens, views

    serving.key.rpm_limit = 1
    serving.key.tpm_limit = 100  # the large prompt alone is over it, refused after it is counted
    serving.key.save()
    counted_on: list[str] = []
    real = tokens.prompt_count

    def spy(body, *, chat, tokenizer_path):
        counted_on.append(threading.current_thread().name)
        return real(body, chat=chat, tokenizer_path=tokenizer_path)

    monkeypatch.setattr(tokens, "prompt_count", spy)
    monkeypatch.setattr(views, "prompt_count", spy)
    # A limiter of this test's own event loop.
    monkeypatch.setattr(views, "_limiters", PerLoop(views._new_limiter))
    large = json.dumps(chat_body(serving.model, "word " * 2000))

    async def go():
        factory = AsyncRequestFactory()
        try:
            return [
                await views.chat_completions(
                    factory.post(
                        "/v1/chat/completions",
                        data=large,
                        content_type="application/json",
                        headers={"Authorization": f"Bearer {serving.token}"},
                    )
                )
                for _ in range(2)
            ]
        finally:
            await sync_to_async(connections.close_all)()

    first, second = run_async(go())
    assert json.loads(first.content)["error"]["code"] == "tokens_exceed_quota"
    assert json.loads(second.content)["error"]["code"] == "rate_limit_exceeded"
    # Counted once (the second request was refused by its rate first), on the counting pool.
    assert len(counted_on) == 1
    assert counted_on[0].startswith("prompt-count")


def test_it_refuses_more_prompts_than_the_classs_share_of_the_cap_naming_prompt(gateway, serving):
    # Cap 4, batch share 0.5: a batch request's prompts may take 2 slots, an interactive one's 4.
    from portal.teams.services import api_key_create

    serving.deployment.concurrency_cap = 4
    serving.deployment.save()
    _key, token = api_key_create(
        team=serving.team, name="offline", allowed_models=[serving.model], priority_class="batch"
    )
    batch = {"Authorization": f"Bearer {token}"}
    url = f"{gateway.url}/v1/completions"

    def send(headers: dict, prompts: int) -> httpx.Response:
        body = {"model": serving.model, "prompt": ["a"] * prompts, "max_tokens": 2}
        return httpx.post(url, headers=headers, json=body, timeout=30)

    refused = error_of(send(batch, 8), 400)
    assert (
        refused["param"] == "prompt" and "at most 2" in refused["message"] and "batch" in refused["message"]
    )
    assert send(batch, 2).status_code == 200
    assert error_of(send(serving.headers, 5), 400)["param"] == "prompt"
    assert send(serving.headers, 4).status_code == 200
