"""The proxy end to end: uvicorn + the gateway + a fake upstream, real PostgreSQL and Redis."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.helpers.gateway import chat_body, make_setup, upstream_stats, wait_for_slots_free

pytestmark = [pytest.mark.django_db(transaction=True)]


def sse_events(raw: bytes) -> list[bytes]:
    return [e for e in raw.split(b"\n\n") if e]


def test_it_streams_a_chat_completion_through(gateway, serving):
    with httpx.stream(
        "POST", f"{gateway.url}/v1/chat/completions", headers=serving.headers,
        json=chat_body(serving.model, stream=True, max_tokens=8),
    ) as response:  # fmt: skip
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read()
    events = sse_events(raw)
    assert events[-1] == b"data: [DONE]"
    contents = [json.loads(e[6:]) for e in events[:-1]]
    assert [c["choices"][0].get("delta", {}).get("content") for c in contents[:-1]] == ["tok "] * 8
    # The client did not ask for usage: the gateway asked upstream for it, then stripped it.
    assert all("usage" not in c for c in contents)


def test_it_passes_the_stream_through_byte_for_byte(gateway, serving):
    body = chat_body(serving.model, stream=True, max_tokens=5, stream_options={"include_usage": True})
    direct = httpx.post(f"{serving.upstream}/v1/chat/completions", json=body).content
    through = httpx.post(f"{gateway.url}/v1/chat/completions", headers=serving.headers, json=body).content

    def without_created(raw: bytes) -> bytes:
        import re

        return re.sub(rb'"created":\d+', b'"created":0', raw)

    assert without_created(through) == without_created(direct)
    assert b'"usage":{"prompt_tokens"' in through


def test_it_answers_a_non_streamed_completion(gateway, serving):
    response = httpx.post(
        f"{gateway.url}/v1/completions", headers=serving.headers,
        json={"model": serving.model, "prompt": "Once upon", "max_tokens": 4},
    )  # fmt: skip
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] == 4
    assert response.headers["x-request-id"]


def test_it_clamps_max_tokens_and_asks_upstream_for_usage(gateway, serving):
    httpx.post(
        f"{gateway.url}/v1/chat/completions", headers=serving.headers,
        json=chat_body(serving.model, stream=True, max_tokens=100000),
    ).read()  # fmt: skip
    sent = upstream_stats(serving.upstream)["last_body"]
    assert sent["max_tokens"] == 1024
    assert sent["stream_options"] == {"include_usage": True}


def test_a_request_without_max_tokens_is_bounded_by_the_models_context(
    gateway, team, cpu_node, fake_upstream, gw_redis
):
    """The key page's snippets send no max_tokens: to a 512-token model with the team's clamp of
    1024, that was a 400 from vLLM (`max_tokens=1024 cannot be greater than max_model_len=512`)."""
    from portal.gateway.tokens import prompt_tokens

    setup = make_setup(team=team, node=cpu_node, upstream=fake_upstream, max_model_len=512)
    team.tpm_limit = 600  # the clamp's reservation (prompt + 1024) would be refused outright
    team.save()
    body = chat_body(setup.model)
    response = httpx.post(f"{gateway.url}/v1/chat/completions", headers=setup.headers, json=body)
    assert response.status_code == 200, response.text
    room = 512 - prompt_tokens(body, chat=True, tokenizer_path=None)
    assert upstream_stats(fake_upstream)["last_body"]["max_tokens"] == room

    # An explicit max_tokens over the context is lowered the same way (docs/decisions.md).
    body = chat_body(setup.model, stream=True, max_completion_tokens=5000, max_tokens=700)
    httpx.post(f"{gateway.url}/v1/chat/completions", headers=setup.headers, json=body).read()
    sent = upstream_stats(fake_upstream)["last_body"]
    assert (sent["max_completion_tokens"], sent["max_tokens"]) == (room, room)


def test_a_batch_of_prompts_is_bounded_by_its_longest_prompt(
    gateway, team, cpu_node, fake_upstream, gw_redis
):
    setup = make_setup(team=team, node=cpu_node, upstream=fake_upstream, max_model_len=512)
    prompts = ["x" * 400, "y" * 40]  # 100 and 10 tokens by the 4-characters estimate
    response = httpx.post(
        f"{gateway.url}/v1/completions", headers=setup.headers, json={"model": setup.model, "prompt": prompts}
    )
    assert response.status_code == 200, response.text
    assert upstream_stats(fake_upstream)["last_body"]["max_tokens"] == 512 - 100


def test_it_releases_every_slot_after_success(gateway, serving, gw_redis):
    serving.team.max_concurrent = 5
    serving.team.save()
    serving.key.max_concurrent = 5
    serving.key.save()
    response = httpx.post(
        f"{gateway.url}/v1/chat/completions",
        headers=serving.headers,
        json=chat_body(serving.model, stream=True),
    )
    assert response.status_code == 200
    assert wait_for_slots_free(gw_redis, serving) == {"team": 0, "key": 0, "deployment": 0, "long": 0}
