"""The proxy end to end: uvicorn + the gateway + a fake upstream, real PostgreSQL and Redis."""

from __future__ import annotations

import json

import httpx
import pytest

from .conftest import chat_body, upstream_stats, wait_for_slots_free

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.integration]


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
