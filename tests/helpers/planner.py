"""Real model architectures (from their config.json on the Hugging Face Hub), for the planner."""

from __future__ import annotations

from dataclasses import replace

from inference.modelspec import ModelArch


def llama2_7b(**changes) -> ModelArch:
    arch = ModelArch(
        model_type="llama",
        num_layers=32,
        hidden_size=4096,
        num_attention_heads=32,
        num_kv_heads=32,
        head_dim=128,
        intermediate_size=11008,
        vocab_size=32000,
        tie_word_embeddings=False,
        max_position_embeddings=4096,
        weight_dtype="float16",
    )
    return replace(arch, **changes)


def gemma2_27b_gptq(**changes) -> ModelArch:
    arch = ModelArch(
        model_type="gemma2",
        num_layers=46,
        hidden_size=4608,
        num_attention_heads=32,
        num_kv_heads=16,
        head_dim=128,
        intermediate_size=36864,
        vocab_size=256000,
        tie_word_embeddings=True,
        max_position_embeddings=8192,
        weight_dtype="float16",
        quantization="gptq",
        quant_bits=4,
        quant_group_size=128,
    )
    return replace(arch, **changes)


def llama31_70b_gptq(**changes) -> ModelArch:
    arch = ModelArch(
        model_type="llama",
        num_layers=80,
        hidden_size=8192,
        num_attention_heads=64,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=28672,
        vocab_size=128256,
        tie_word_embeddings=False,
        max_position_embeddings=131072,
        weight_dtype="float16",
        quantization="gptq",
        quant_bits=4,
        quant_group_size=128,
    )
    return replace(arch, **changes)


def llama31_70b_fp16() -> ModelArch:
    return llama31_70b_gptq(quantization=None, quant_bits=None, quant_group_size=None)
