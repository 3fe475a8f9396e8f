"""Hand-written safetensors files for the conversion tests (numpy has no bfloat16, so bf16
tensors are given as their uint16 bit patterns; expected fp16 bits come from Python's own IEEE
half packing, `struct` format "e", not numpy)."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import numpy as np
from safetensors import safe_open

CONFIG = {"model_type": "llama", "torch_dtype": "bfloat16", "hidden_size": 8}


def bf16_bits(value: float) -> int:
    """bf16 bit pattern of a value that bf16 represents exactly (the top half of its float32)."""
    bits = struct.unpack("<I", struct.pack("<f", value))[0]
    assert bits & 0xFFFF == 0, f"{value} is not exactly representable in bf16"
    return bits >> 16


def bf16_value(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits << 16))[0]


def expected_fp16_bits(bits: int, *, clamp: bool = False) -> int:
    """IEEE round-half-to-even of the exact bf16 value into binary16, by Python's struct."""
    value = bf16_value(bits)
    if math.isnan(value):
        return 0x7E00 | (bits & 0x8000)
    try:
        return struct.unpack("<H", struct.pack("<e", value))[0]
    except OverflowError:
        sign = bits & 0x8000
        return sign | (0x7BFF if clamp else 0x7C00)


def write_safetensors(path: Path, tensors: dict[str, tuple[str, tuple[int, ...], bytes]], metadata=None):
    """A safetensors file: {name: (dtype, shape, raw little-endian bytes)}."""
    header: dict = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
    body = json.dumps(header).encode()
    body += b" " * (-len(body) % 8)
    path.write_bytes(struct.pack("<Q", len(body)) + body + b"".join(raw for _, _, raw in tensors.values()))


def bf16_tensor(bits, shape=None) -> tuple[str, tuple[int, ...], bytes]:
    arr = np.asarray(bits, dtype="<u2")
    return ("BF16", shape or arr.shape, arr.tobytes())


def make_model(root: Path, shards: dict[str, dict], config=None, extra=None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for name, tensors in shards.items():
        write_safetensors(root / name, tensors, metadata={"format": "pt"})
    (root / "config.json").write_text(json.dumps(config or CONFIG))
    (root / "tokenizer.json").write_text('{"model": {"vocab": {"a": 0}}}')
    (root / "tokenizer_config.json").write_text('{"bos_token": "<s>"}')
    for name, content in (extra or {}).items():
        (root / name).write_bytes(content)
    return root


def fp16_bits_of(path: Path, name: str) -> np.ndarray:
    with safe_open(str(path), framework="numpy") as f:
        arr = f.get_tensor(name)
    assert arr.dtype == np.float16
    return arr.view(np.uint16).ravel()
