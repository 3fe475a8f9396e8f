"""The fp16 copy of a bf16 checkpoint loads and generates in real vLLM (the CPU build)."""

from __future__ import annotations

import json
import shutil

import httpx
import numpy as np
import pytest
from django.core.management import call_command
from safetensors import safe_open

from portal.registry.models import ModelVersion
from portal.registry.services import model_version_create
from tests.helpers.engines import start_vllm_server, stop_vllm_server
from tests.helpers.safetensors import write_safetensors

pytestmark = [pytest.mark.django_db, pytest.mark.vllm]


def to_bf16_bits(values: np.ndarray) -> np.ndarray:
    """float32 → bf16 bit patterns, rounded to nearest even (as torch's cast does)."""
    bits = values.astype("<f4").view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype("<u2")


def test_vllm_serves_the_converted_tiny_model(tiny_model_dir, tmp_path):
    bf16_dir = tmp_path / "tiny-bf16"
    bf16_dir.mkdir()
    with safe_open(str(tiny_model_dir / "model.safetensors"), framework="numpy") as f:
        tensors = {
            name: ("BF16", f.get_tensor(name).shape, to_bf16_bits(f.get_tensor(name)).tobytes())
            for name in f.keys()  # noqa: SIM118 (safe_open is not a mapping)
        }
    write_safetensors(bf16_dir / "model.safetensors", tensors, metadata={"format": "pt"})
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(tiny_model_dir / name, bf16_dir / name)
    config = {**json.loads((tiny_model_dir / "config.json").read_text()), "torch_dtype": "bfloat16"}
    (bf16_dir / "config.json").write_text(json.dumps(config))
    model_version_create(name="tiny-bf16", config=config, path=str(bf16_dir))

    call_command("convert_bf16", "--model", "tiny-bf16")
    converted = ModelVersion.objects.get(name="tiny-bf16-fp16")
    assert converted.weight_dtype == "float16"

    server = start_vllm_server(tmp_path / "tiny-bf16-fp16", tmp_path / "vllm.log", model=converted.name)
    try:
        reply = httpx.post(
            f"{server.base_url}/v1/completions",
            json={"model": converted.name, "prompt": "The module", "max_tokens": 8, "temperature": 0},
            timeout=120,
        )
        assert reply.status_code == 200, reply.text
        choice = reply.json()["choices"][0]
        assert choice["text"].strip()
        assert reply.json()["usage"]["completion_tokens"] > 0
    finally:
        stop_vllm_server(server)
