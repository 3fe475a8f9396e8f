"""The safetensors file format's header: an 8-byte little-endian length, then JSON naming each
tensor's dtype, shape and byte range in the data section that follows.

Read and written by hand (not by the `safetensors` package) because the bf16 → fp16 conversion
(inference/convert.py) streams shards without torch and rewrites only the header: it needs the byte
ranges, checked, before it reads a byte of data. docs/decisions.md says why.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from inference.errors import InputError

# safetensors' own loader refuses headers above 100 MB; so do we, before allocating.
MAX_HEADER_BYTES = 100 << 20
DTYPE_SIZES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # offsets relative to the data section, as in the header
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class ShardHeader:
    path: Path
    header_len: int
    metadata: dict[str, str] | None
    tensors: tuple[TensorInfo, ...]  # in data order

    @property
    def data_start(self) -> int:
        return 8 + self.header_len


def read_header(path: str | Path) -> ShardHeader:
    """Parse and check a safetensors header: offsets in range, contiguous, sizes matching shapes."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise InputError("path", f"{path.name}: too short to be a safetensors file")
        (header_len,) = struct.unpack("<Q", raw)
        if header_len > MAX_HEADER_BYTES or 8 + header_len > size:
            raise InputError("path", f"{path.name}: header length {header_len} is not plausible")
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise InputError("path", f"{path.name}: header is not JSON: {error}") from error
    if not isinstance(header, dict):
        raise InputError("path", f"{path.name}: header is not a JSON object")
    metadata = header.pop("__metadata__", None)
    tensors = []
    for name, info in header.items():
        try:
            dtype, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError) as error:
            raise InputError("path", f"{path.name}: tensor {name!r} has a malformed entry") from error
        if not (isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end):
            raise InputError("path", f"{path.name}: tensor {name!r} has bad offsets")
        if dtype in DTYPE_SIZES and int(np.prod(shape, dtype=np.int64)) * DTYPE_SIZES[dtype] != end - begin:
            raise InputError("path", f"{path.name}: tensor {name!r} size does not match {dtype}{list(shape)}")
        tensors.append(TensorInfo(name, dtype, shape, begin, end))
    tensors.sort(key=lambda t: (t.begin, t.end))
    position = 0
    for tensor in tensors:
        if tensor.begin != position:
            raise InputError("path", f"{path.name}: tensor data is not contiguous at {tensor.name!r}")
        position = tensor.end
    if 8 + header_len + position != size:
        raise InputError("path", f"{path.name}: file size does not match its header (truncated?)")
    return ShardHeader(path=path, header_len=header_len, metadata=metadata, tensors=tuple(tensors))


def encode_header(
    metadata: dict[str, str] | None, tensors: list[TensorInfo] | tuple[TensorInfo, ...]
) -> bytes:
    """Length prefix + JSON header, space-padded so the data starts 8-byte aligned (as safetensors does)."""
    header: dict[str, Any] = {}
    if metadata is not None:
        header["__metadata__"] = metadata
    for t in tensors:
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [t.begin, t.end]}
    body = json.dumps(header, separators=(",", ":")).encode("utf-8")
    body += b" " * (-len(body) % 8)
    return struct.pack("<Q", len(body)) + body
