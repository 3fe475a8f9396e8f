"""The simulated server's API has the shapes the gateway and the benchmark read from vLLM."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp.test_utils import TestClient, TestServer

from inference.sim.cli import build_parser, engine_from_args, main
from inference.sim.server import SERVER_KEY, SimServer
from inference.vllm_metrics import histogram_totals, parse_vllm_metrics
from tests.helpers.sim import ARGV, completion


def run(scenario):
    """Run `scenario(client)` against a fresh simulated server at 50× speed."""

    async def go():
        args = build_parser().parse_args(ARGV)
        engine, tokenizer, root = engine_from_args(args)
        server = SimServer(
            engine, served_model_names=["llama-2-7b"], tokenizer=tokenizer, model_root=root, speedup=50
        )
        async with TestClient(TestServer(server.app())) as client:
            return await scenario(client)

    return asyncio.run(go())


async def sse(response) -> list[dict | str]:
    events = []
    text = await response.text()
    for block in text.split("\n\n"):
        block = block.strip()
        if block:
            data = block.removeprefix("data: ")
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_it_streams_a_completion_token_by_token_then_usage_then_done():
    async def scenario(client):
        body = completion(max_tokens=5, ignore_eos=True, stream=True, stream_options={"include_usage": True})
        response = await client.post("/v1/completions", json=body)
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/event-stream")
        return await sse(response)

    events = run(scenario)
    tokens = [e for e in events[:-1] if e["choices"]]
    assert len(tokens) == 5  # the benchmark counts chunks with choices as token events
    assert all(e["object"] == "text_completion" and e["choices"][0]["text"] for e in tokens)
    assert [e["choices"][0]["finish_reason"] for e in tokens] == [None] * 4 + ["length"]
    usage = events[-2]
    assert usage["choices"] == []
    assert usage["usage"]["completion_tokens"] == 5
    assert usage["usage"]["total_tokens"] == usage["usage"]["prompt_tokens"] + 5
    assert events[-1] == "[DONE]"


def test_it_streams_chat_with_the_role_first_and_a_final_usage_chunk():
    async def scenario(client):
        body = {
            "model": "llama-2-7b",
            "messages": [{"role": "user", "content": "Say hello."}],
            "max_tokens": 3,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        return await sse(await client.post("/v1/chat/completions", json=body))

    events = run(scenario)
    assert events[0]["object"] == "chat.completion.chunk"
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    contents = [e["choices"][0]["delta"]["content"] for e in events[1:-2]]
    assert len(contents) == 3 and all(contents)
    assert events[-3]["choices"][0]["finish_reason"] == "length"
    assert events[-2]["usage"]["completion_tokens"] == 3
    assert events[-1] == "[DONE]"


def test_it_answers_without_streaming_with_text_and_usage():
    async def scenario(client):
        response = await client.post("/v1/completions", json=completion(max_tokens=4, ignore_eos=True))
        return response.status, await response.json()

    status, body = run(scenario)
    assert status == 200
    assert body["object"] == "text_completion"
    assert body["choices"][0]["finish_reason"] == "length"
    assert len(body["choices"][0]["text"].split()) == 4
    assert body["usage"]["completion_tokens"] == 4


def test_it_honours_min_tokens_before_stopping_on_eos():
    async def scenario(client):
        response = await client.post("/v1/completions", json=completion(max_tokens=400, min_tokens=300))
        return await response.json()

    body = run(scenario)
    assert body["usage"]["completion_tokens"] >= 300


def test_it_refuses_a_request_longer_than_max_model_len_as_vllm_does():
    async def scenario(client):
        response = await client.post("/v1/completions", json=completion(max_tokens=5000))
        return response.status, await response.json()

    status, body = run(scenario)
    assert status == 400
    assert "maximum context length is 4096 tokens" in body["error"]["message"]
    assert body["error"]["type"] == "BadRequestError"


def test_it_answers_404_for_a_model_it_does_not_serve():
    async def scenario(client):
        response = await client.post("/v1/completions", json={"model": "gpt-4", "prompt": "hi"})
        return response.status, await response.json()

    status, body = run(scenario)
    assert status == 404
    assert "gpt-4" in body["error"]["message"]


def test_it_serves_health_and_models():
    async def scenario(client):
        health = await client.get("/health")
        models = await (await client.get("/v1/models")).json()
        return health.status, models

    status, models = run(scenario)
    assert status == 200
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == ["llama-2-7b"]
    assert models["data"][0]["max_model_len"] == 4096


def test_it_reports_vllm_metrics_that_the_portal_parses():
    async def scenario(client):
        await client.post("/v1/completions", json=completion(max_tokens=6, ignore_eos=True))
        return await (await client.get("/metrics")).text()

    text = run(scenario)
    metrics = parse_vllm_metrics(text)
    assert metrics.generation_tokens == 6
    assert metrics.requests_finished == 1
    assert metrics.prompt_tokens > 0
    assert metrics.running == 0 and metrics.waiting == 0
    assert metrics.preemptions == 0
    assert 0 <= metrics.kv_cache_usage <= 1
    assert histogram_totals(text, "vllm:time_to_first_token_seconds")[1] == 1
    assert histogram_totals(text, "vllm:time_per_output_token_seconds")[1] == 5


def test_it_streams_tokens_at_simulated_step_times():
    async def scenario(client):
        loop = asyncio.get_running_loop()
        started = loop.time()
        await client.post("/v1/completions", json=completion(max_tokens=20, ignore_eos=True))
        return loop.time() - started

    elapsed = run(scenario)
    # 20 steps of a 7B TP8 model take ~0.2 s simulated; at 50× that is a few milliseconds, not zero.
    assert 0.001 < elapsed < 1.0


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--dtype", "bfloat16"],
            "Bfloat16 is only supported on GPUs with compute capability of at least 8.0",
        ),
        (
            ["--model", "llama-3.1-70b-instruct-gptq-4bit", "--quantization", "awq", "-tp", "8"],
            "not supported",
        ),
        (["--max-model-len", "4096", "--gpu-memory-utilization", "0.45"], "KV cache"),
        (["--tensor-parallel-size", "3"], "must be divisible by tensor parallel size (3)"),
        (["--hardware", "v200"], "unknown GPU"),
    ],
)
def test_it_refuses_at_startup_what_vllm_would_refuse(flags, message, capsys):
    argv = ["--model", "llama-2-7b-chat-hf", "--hardware", "v100-sxm2-32gb", "--dtype", "float16", *flags]
    assert main(argv) == 1
    assert message in capsys.readouterr().err


def test_it_refuses_flags_vllm_does_not_have():
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["--model", "x", "--hardware", "t4", "--max-num-sequences", "3"])
    assert exit_info.value.code == 2


def test_it_accepts_every_flag_our_profiles_emit():
    args = build_parser().parse_args(
        [*ARGV, "--max-num-seqs", "128", "--max-num-batched-tokens", "4096", "--block-size", "32",
         "--swap-space", "4", "--kv-cache-dtype", "auto", "--seed", "1", "--quantization", "gptq",
         "--port", "8123", "--host", "127.0.0.1"]
    )  # fmt: skip
    assert (args.max_num_seqs, args.block_size, args.port) == (128, 32, 8123)
    defaults = build_parser().parse_args(["--model", "x"])
    assert (defaults.host, defaults.hardware) == ("127.0.0.1", "v100-sxm2-32gb")


def test_it_answers_503_once_the_engine_has_failed():
    async def scenario(client):
        server = client.server.app[SERVER_KEY]
        server.engine.scheduler.schedule = lambda: 1 / 0  # a bug in the engine loop
        failed = await client.post("/v1/completions", json=completion(max_tokens=3))
        await asyncio.sleep(0.05)
        health = await client.get("/health")
        later = await client.post("/v1/completions", json=completion(max_tokens=3))
        return failed.status, health.status, later.status, (await later.json())["error"]["type"]

    failed, health, later, kind = run(scenario)
    assert failed == 500
    assert health == 503
    assert later == 503 and kind == "EngineDeadError"


def test_it_guards_v1_with_vllm_api_key_and_leaves_health_and_metrics_open():
    async def go():
        args = build_parser().parse_args(ARGV)
        engine, tokenizer, root = engine_from_args(args)
        server = SimServer(
            engine, served_model_names=["llama-2-7b"], tokenizer=tokenizer, model_root=root, speedup=50,
            api_key="sim-key",
        )  # fmt: skip
        async with TestClient(TestServer(server.app())) as client:
            bearer = {"Authorization": "Bearer sim-key"}
            body = completion(max_tokens=2)
            return [
                (await client.get("/v1/models")).status,
                (await client.post("/v1/completions", json=body)).status,
                (await client.get("/v1/models", headers={"Authorization": "Bearer nope"})).status,
                (await client.get("/v1/models", headers=bearer)).status,
                (await client.post("/v1/completions", json=body, headers=bearer)).status,
                (await client.get("/health")).status,
                (await client.get("/metrics")).status,
            ]

    assert asyncio.run(go()) == [401, 401, 401, 200, 200, 200, 200]


def test_it_reads_the_api_key_from_the_environment_like_vllm(monkeypatch):
    captured = {}
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    monkeypatch.setattr(
        "aiohttp.web.run_app", lambda app, **kw: captured.setdefault("key", app[SERVER_KEY].api_key)
    )
    assert main([*ARGV, "--port", "1"]) == 0
    assert captured["key"] == "from-env"
