"""Throughput of the bf16 → fp16 conversion (inference.convert) on a generated model.

    .venv/bin/python scripts/bench_convert.py [--mb 200] [--shards 2] [--repeat 3] [--dir /tmp]

Writes a bf16 safetensors model of about --mb megabytes (normal values with a
weight-like scale, std 0.02), converts it with several chunk sizes, and prints a
table in MB/s (decimal; input bytes per wall-clock second, hashing and fsync
included). The baseline row is a plain file copy of the same bytes, the disk's
ceiling for a read + write pass.
"""

from __future__ import annotations

import argparse
import json
import shutil
import struct
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from inference.convert import convert_model_dir


def write_model(root: Path, total_mb: int, shards: int) -> int:
    root.mkdir(parents=True)
    rng = np.random.default_rng(0)
    per_shard = total_mb * 1_000_000 // shards
    tensor_elems = 4096 * 1024  # 8 MB per bf16 tensor, like a 4096×1024 projection
    written = 0
    for s in range(shards):
        header, blobs, offset = {"__metadata__": {"format": "pt"}}, [], 0
        for i in range(max(1, -(-per_shard // (tensor_elems * 2)))):
            f32 = (rng.standard_normal(tensor_elems, dtype=np.float32) * 0.02).view(np.uint32)
            raw = (f32 >> 16).astype("<u2").tobytes()
            header[f"layers.{s}.{i}.weight"] = {
                "dtype": "BF16",
                "shape": [4096, 1024],
                "data_offsets": [offset, offset + len(raw)],
            }
            blobs.append(raw)
            offset += len(raw)
        body = json.dumps(header).encode()
        body += b" " * (-len(body) % 8)
        path = root / f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(body)) + body)
            for blob in blobs:
                f.write(blob)
        written += path.stat().st_size
    (root / "config.json").write_text(json.dumps({"model_type": "llama", "torch_dtype": "bfloat16"}))
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=200)
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp)
        size = write_model(root / "src", args.mb, args.shards)
        rows = []
        best = float("inf")
        for _ in range(args.repeat):
            start = time.perf_counter()
            shutil.copytree(root / "src", root / "copy")
            best = min(best, time.perf_counter() - start)
            shutil.rmtree(root / "copy")
        rows.append(("plain copy (baseline)", "-", best))
        for chunk_kib in (256, 1024, 4096, 16384):
            best = float("inf")
            for _ in range(args.repeat):
                start = time.perf_counter()
                report = convert_model_dir(root / "src", root / "out", chunk_bytes=chunk_kib << 10)
                best = min(best, time.perf_counter() - start)
                shutil.rmtree(root / "out")
            rows.append(("convert bf16→fp16", f"{chunk_kib} KiB", best))
        print(
            f"input: {size / 1e6:.0f} MB bf16 in {args.shards} shards, "
            f"{report.tensors_total} tensors; best of {args.repeat}"
        )
        print(f"{'what':<24} {'chunk':>9} {'seconds':>8} {'MB/s':>7}")
        for what, chunk, seconds in rows:
            print(f"{what:<24} {chunk:>9} {seconds:>8.2f} {size / 1e6 / seconds:>7.0f}")


if __name__ == "__main__":
    main()
