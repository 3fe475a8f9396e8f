"""bf16 → fp16 conversion of a safetensors model directory, streamed.

A V100 has no bf16 support (docs/v100-field-guide.md#hardware); a bf16 checkpoint loaded there gave
garbage tokens (or a slow fallback) with no startup error. The fix is a copy of
the checkpoint in float16. This module writes that copy without torch and
without holding a model in memory:

- Each `*.safetensors` shard is read by its own header (8-byte little-endian
  length + JSON; inference/safetensors_header.py) and tensor byte ranges, one
  tensor at a time and each tensor in chunks of `chunk_bytes`, so memory stays
  bounded whatever the tensor size.
  bf16 and fp16 are both 2 bytes, so the output header is the input header with
  `BF16` renamed `F16` and identical offsets, and the output shard is written
  front to back as it is produced. Other dtypes are copied byte for byte.
- The result is bit for bit what torch's `.to(torch.float16)` gives: the bf16
  value widened exactly to float32 (its 16 bits become the top half of a
  float32), then rounded once to float16, half to even. Where the result is a
  normal fp16 no rounding happens at all (bf16's 7 mantissa bits fit in fp16's
  10), so that bulk is done with 16-bit integer arithmetic; only zeros, fp16
  subnormals, overflows, inf and NaN take the float path.
- Range: the largest finite fp16 is 65504. The bf16 values nearest to it are
  65280 (exact in fp16) and 65536 (becomes inf), so a finite bf16 value
  overflows exactly when |x| > 65504, i.e. when its magnitude bits are
  ≥ 0x4780. Those are counted per tensor. Without `clamp` the conversion stops
  writing at the first one, keeps scanning so the report lists every
  overflowing tensor, and raises `Fp16RangeError`; with `clamp` they become
  ±65504 and the report says how many per tensor.
- NaN and ±inf in the input are not overflows: they stay NaN (sign kept, quiet,
  payload truncated to fp16's mantissa) and ±inf, are never clamped, and are
  counted as `nonfinite_total`. Nonzero values with |x| ≤ 2**-25 round to
  (signed) zero in fp16; they are counted as `underflow_total` for information
  and do not stop anything (they were below fp16's resolution anyway).
- `config.json` is rewritten with `torch_dtype` (and `dtype`, where present,
  also in a nested `text_config`) set to float16; the tokenizer, the shard
  index and the other small files are copied. Non-safetensors weights
  (`*.bin`, `*.pt`, …) are not converted: beside safetensors shards they are
  skipped (Llama repos carry an `original/` copy), alone they are refused.
- Every written file is SHA-256'd as it is written, and the digests are
  grouped exactly as `inference.hashing.hash_model_dir` groups them, so a
  registry record needs no second pass over the output.

`convert_model_dir(src, target)` writes into a hidden temporary directory next
to `target` and renames it into place only when complete; `convert_into` is the
same work into a directory the caller manages (the portal renames inside the
transaction that registers the new model version).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import queue
import shutil
import struct
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from inference.errors import InputError
from inference.hashing import ModelHashes, classify, group_digest
from inference.safetensors_header import ShardHeader, TensorInfo, encode_header, read_header

FP16_MAX = 65504.0
# Magnitude bits (sign masked off) of bf16 values, see the module docstring.
_BF16_OVERFLOW_BITS = 0x4780  # 65536: the smallest finite bf16 above 65504
_BF16_INF_BITS = 0x7F80  # inf; above it NaN
_BF16_UNDERFLOW_MAX_BITS = 0x3300  # 2**-25: ties to even, so it and everything below become 0
_BF16_FP16_NORMAL_MIN_BITS = 0x3880  # 2**-14, the smallest normal fp16
_BF16_REBIAS = 112 << 7  # exponent bias 127 (bf16) → 15 (fp16), in bf16's exponent position
_FP16_MAX_BITS = 0x7BFF  # 65504

DEFAULT_CHUNK_BYTES = 1 << 20  # fastest of 256 KiB..16 MiB in scripts/bench_convert.py
OTHER_WEIGHT_SUFFIXES = (".bin", ".pt", ".pth", ".gguf")
PARTIAL_MARK = ".partial-"


@dataclass
class TensorRangeReport:
    file: str
    tensor: str
    overflow: int = 0  # finite values with |x| > 65504
    max_abs: float = 0.0  # largest finite magnitude among them


@dataclass
class ConversionProgress:
    file: str
    tensor: str
    tensors_done: int
    tensors_total: int
    bytes_done: int
    bytes_total: int
    overflow_total: int


@dataclass
class ConversionReport:
    tensors_total: int = 0
    tensors_converted: int = 0  # bf16 → fp16
    tensors_copied: int = 0  # other dtypes, byte for byte
    bytes_total: int = 0
    clamp: bool = False
    overflow_total: int = 0
    overflows: list[TensorRangeReport] = field(default_factory=list)
    nonfinite_total: int = 0
    underflow_total: int = 0
    files_written: dict[str, str] = field(default_factory=dict)  # relpath → sha256 of what was written
    skipped: list[str] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)  # the rewritten config.json
    seconds: float = 0.0

    @property
    def mb_per_s(self) -> float:
        return self.bytes_total / 1e6 / self.seconds if self.seconds > 0 else 0.0

    def hashes(self) -> ModelHashes:
        """The release hashes of the output, grouped as `hash_model_dir` groups them."""
        weights = {p: d for p, d in self.files_written.items() if classify(p) == "weights"}
        tokenizer = {p: d for p, d in self.files_written.items() if classify(p) == "tokenizer"}
        return ModelHashes(
            weights_sha256=group_digest(weights),
            tokenizer_sha256=group_digest(tokenizer),
            weight_files=dict(sorted(weights.items())),
            tokenizer_files=dict(sorted(tokenizer.items())),
        )

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("config")
        data["mb_per_s"] = round(self.mb_per_s, 1)
        return data

    def summary(self) -> str:
        lines = [
            f"{self.tensors_total} tensors ({self.tensors_converted} bf16 → fp16, "
            f"{self.tensors_copied} copied), {self.bytes_total / 1e6:.1f} MB "
            f"in {self.seconds:.1f} s ({self.mb_per_s:.0f} MB/s)",
        ]
        if self.overflow_total:
            verb = "clamped to ±65504" if self.clamp else "would overflow to inf"
            lines.append(f"{self.overflow_total} values in {len(self.overflows)} tensors {verb}:")
            lines.extend(
                f"  {o.file}:{o.tensor}  {o.overflow} values (max |x| {o.max_abs:g})" for o in self.overflows
            )
        else:
            lines.append("no value outside fp16's range (|x| ≤ 65504)")
        if self.nonfinite_total:
            lines.append(f"{self.nonfinite_total} NaN/inf values kept as they are")
        if self.underflow_total:
            lines.append(f"{self.underflow_total} nonzero values below 2**-25 became zero")
        if self.skipped:
            lines.append("not converted (not safetensors): " + ", ".join(self.skipped))
        return "\n".join(lines)


class Fp16RangeError(Exception):
    """Some bf16 values exceed fp16's range and clamping was not asked for."""

    def __init__(self, report: ConversionReport) -> None:
        self.report = report
        super().__init__(
            f"{report.overflow_total} values in {len(report.overflows)} tensors exceed fp16's range "
            f"(|x| > 65504 would become inf); nothing was written. Convert with clamp to set them to ±65504."
        )


ProgressCallback = Callable[[ConversionProgress], None]


# --- config.json ----------------------------------------------------------------


def fp16_config(config: dict[str, Any]) -> dict[str, Any]:
    """config.json with its dtype set to float16 (`torch_dtype` always; `dtype` and nested ones where set)."""
    out: dict[str, Any] = json.loads(json.dumps(config))
    out["torch_dtype"] = "float16"
    if "dtype" in out:
        out["dtype"] = "float16"
    for value in out.values():
        if isinstance(value, dict):
            for key in ("torch_dtype", "dtype"):
                if key in value:
                    value[key] = "float16"
    return out


# --- the conversion ---------------------------------------------------------------


def bf16_bits_to_fp16(bits: np.ndarray) -> np.ndarray:
    """Reference cast of bf16 bit patterns (uint16) to float16 values (exact widen, one rounding)."""
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float16)


class _HashingWriter:
    def __init__(self, f: BinaryIO) -> None:
        self.f = f
        self.sha = hashlib.sha256()

    def write(self, data: bytes | memoryview) -> None:
        self.sha.update(data)
        self.f.write(data)


class _WriteBehind:
    """Hashes and writes chunks on a thread while the next chunk is converted.

    numpy's ufuncs, hashlib (on buffers over 2 KiB) and file writes all release
    the GIL, so conversion and output overlap. At most `depth` chunks wait in
    the queue and one is being written: a caller that cycles through
    `depth + 2` buffers never overwrites one still in use.
    """

    def __init__(self, depth: int = 2) -> None:
        self.depth = depth
        self.queue: queue.Queue[tuple[_HashingWriter, bytes | memoryview] | None] = queue.Queue(maxsize=depth)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="convert-writer", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            item = self.queue.get()
            try:
                if item is None:
                    return
                if self.error is None:
                    writer, data = item
                    writer.write(data)
            except BaseException as error:  # handed to the converting thread
                self.error = error
            finally:
                self.queue.task_done()

    def _check(self) -> None:
        if self.error is not None:
            error, self.error = self.error, None
            raise error

    def write(self, writer: _HashingWriter, data: bytes | memoryview) -> None:
        self._check()
        self.queue.put((writer, data))

    def drain(self) -> None:
        self.queue.join()
        self._check()

    def close(self) -> None:
        self.queue.put(None)
        self.thread.join()


@dataclass
class _Plan:
    shards: list[tuple[str, ShardHeader]]
    copies: list[str]
    config: str | None
    skipped: list[str]
    tensors_total: int
    bytes_total: int


def _walk(root: Path) -> list[str]:
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        rel_dir = Path(dirpath).relative_to(root)
        found.extend((rel_dir / name).as_posix() for name in sorted(filenames))
    return found


def plan_dir(src: str | Path) -> _Plan:
    root = Path(src)
    if not root.is_dir():
        raise InputError("path", f"{root} is not a directory")
    files = _walk(root)
    shards = [p for p in files if p.lower().endswith(".safetensors")]
    others = [p for p in files if p.lower().endswith(OTHER_WEIGHT_SUFFIXES) and classify(p) == "weights"]
    if not shards:
        found = f" (found {', '.join(others)}; convert them to safetensors first)" if others else ""
        raise InputError("path", f"no *.safetensors weights in {root}{found}")
    headers = [(p, read_header(root / p)) for p in shards]
    config = "config.json" if "config.json" in files else None
    copies = [p for p in files if p not in shards and p not in others and p != config]
    size = sum((root / p).stat().st_size for p in files if p not in others)
    return _Plan(
        shards=headers,
        copies=copies,
        config=config,
        skipped=others,
        tensors_total=sum(len(h.tensors) for _, h in headers),
        bytes_total=size,
    )


class _Converter:
    def __init__(
        self,
        src: Path,
        dst: Path,
        plan: _Plan,
        *,
        clamp: bool,
        progress: ProgressCallback | None,
        chunk_bytes: int,
    ) -> None:
        self.src, self.dst, self.plan = src, dst, plan
        self.clamp = clamp
        self.progress = progress
        self.chunk = max(2, chunk_bytes - chunk_bytes % 8)
        self.report = ConversionReport(
            tensors_total=plan.tensors_total, bytes_total=plan.bytes_total, clamp=clamp, skipped=plan.skipped
        )
        self.tensors_done = 0
        self.bytes_done = 0
        # Without clamp, the first overflow dooms the output: stop writing, keep counting.
        self.writing = True
        n = self.chunk // 2
        self._mag = np.empty(n, np.uint16)
        self._tmp = np.empty(n, np.uint16)
        self._mask = np.empty(n, np.bool_)
        self._buf = bytearray(self.chunk)
        self._wb = _WriteBehind()
        self._ring = [bytearray(self.chunk) for _ in range(self._wb.depth + 2)]
        self._slot = 0

    def _next_slot(self) -> memoryview:
        """A chunk buffer that no queued write still uses (see _WriteBehind)."""
        self._slot = (self._slot + 1) % len(self._ring)
        return memoryview(self._ring[self._slot])

    def _tick(self, file: str, tensor: str) -> None:
        if self.progress is not None:
            self.progress(
                ConversionProgress(
                    file=file,
                    tensor=tensor,
                    tensors_done=self.tensors_done,
                    tensors_total=self.plan.tensors_total,
                    bytes_done=self.bytes_done,
                    bytes_total=self.plan.bytes_total,
                    overflow_total=self.report.overflow_total,
                )
            )

    def _stop_writing(self) -> None:
        self.writing = False
        with contextlib.suppress(OSError):  # the output is being thrown away anyway
            self._wb.drain()
        shutil.rmtree(self.dst, ignore_errors=True)
        self.dst.mkdir(parents=True, exist_ok=True)

    def run(self) -> ConversionReport:
        start = time.perf_counter()
        try:
            for relpath, header in self.plan.shards:
                self._shard(relpath, header)
            if self.plan.config is not None:
                self._config(self.plan.config)
            for relpath in self.plan.copies:
                self._copy(relpath)
        finally:
            self._wb.close()
        self.report.seconds = time.perf_counter() - start
        if self.report.overflow_total and not self.clamp:
            raise Fp16RangeError(self.report)
        return self.report

    def _open(self, relpath: str) -> BinaryIO:
        path = self.dst / relpath
        path.parent.mkdir(parents=True, exist_ok=True)
        return open(path, "wb")

    def _finish(self, relpath: str, f: BinaryIO, writer: _HashingWriter) -> None:
        self._wb.drain()
        f.flush()
        os.fsync(f.fileno())
        f.close()
        self.report.files_written[relpath] = writer.sha.hexdigest()

    def _shard(self, relpath: str, header: ShardHeader) -> None:
        out_tensors = [
            TensorInfo(t.name, "F16" if t.dtype == "BF16" else t.dtype, t.shape, t.begin, t.end)
            for t in header.tensors
        ]
        head = encode_header(header.metadata, out_tensors)
        f = writer = None
        if self.writing:
            f = self._open(relpath)
            writer = _HashingWriter(f)
            self._wb.write(writer, head)
        self.bytes_done += header.data_start
        with open(header.path, "rb") as source:
            source.seek(header.data_start)
            for tensor in header.tensors:
                if tensor.dtype == "BF16":
                    self._bf16_tensor(source, relpath, tensor, writer)
                    self.report.tensors_converted += 1
                else:
                    self._raw_tensor(source, relpath, tensor, writer)
                    self.report.tensors_copied += 1
                self.tensors_done += 1
                self._tick(relpath, tensor.name)
                if not self.writing and f is not None and not f.closed:
                    f.close()
        if f is not None and not f.closed:
            if self.writing:
                assert writer is not None  # opened together with f
                self._finish(relpath, f, writer)
            else:
                f.close()

    def _read(self, source: io.BufferedReader, size: int, into: memoryview | None = None) -> memoryview:
        view = (into if into is not None else memoryview(self._buf))[:size]
        if source.readinto(view) != size:
            raise InputError("path", f"{source.name}: ended early")
        return view

    def _raw_tensor(
        self, source: io.BufferedReader, relpath: str, tensor: TensorInfo, writer: _HashingWriter | None
    ) -> None:
        remaining = tensor.nbytes
        while remaining:
            view = self._read(source, min(remaining, self.chunk), into=self._next_slot())
            if self.writing and writer is not None:
                self._wb.write(writer, view)
            remaining -= len(view)
            self.bytes_done += len(view)
            self._tick(relpath, tensor.name)

    def _bf16_tensor(
        self, source: io.BufferedReader, relpath: str, tensor: TensorInfo, writer: _HashingWriter | None
    ) -> None:
        remaining = tensor.nbytes
        entry = TensorRangeReport(file=relpath, tensor=tensor.name)
        while remaining:
            view = self._read(source, min(remaining, self.chunk))
            n = len(view) // 2
            bits = np.frombuffer(view, dtype="<u2")
            mag, tmp, mask = self._mag[:n], self._tmp[:n], self._mask[:n]
            out = np.frombuffer(self._next_slot(), dtype=np.uint16)[:n]
            np.bitwise_and(bits, 0x7FFF, out=mag)
            # Where the result is a normal fp16 (2**-14 ≤ |x| ≤ 65280) the cast is exact bit
            # arithmetic: same sign, exponent rebiased (127 → 15), bf16's 7 mantissa bits
            # shifted into fp16's 10. That is (mag - 112 << 7) << 3, in 16-bit integers,
            # several times faster than numpy's float32 → float16 cast.
            np.subtract(mag, _BF16_REBIAS, out=out)
            np.left_shift(out, 3, out=out)
            np.bitwise_and(bits, 0x8000, out=tmp)
            np.bitwise_or(out, tmp, out=out)
            # The rest (zero, fp16 subnormals, overflow, inf, NaN) is rare in weights: those
            # go through float32 → float16, which rounds as IEEE does, and are counted.
            np.subtract(mag, _BF16_FP16_NORMAL_MIN_BITS, out=tmp)
            np.greater_equal(tmp, _BF16_OVERFLOW_BITS - _BF16_FP16_NORMAL_MIN_BITS, out=mask)
            where = np.flatnonzero(mask)
            if where.size:
                special, smag = bits[where], mag[where]
                with np.errstate(over="ignore"):  # counted below; inf is the IEEE result
                    out[where] = bf16_bits_to_fp16(special).view(np.uint16)
                nonfinite = smag >= _BF16_INF_BITS
                self.report.nonfinite_total += int(np.count_nonzero(nonfinite))
                over = (smag >= _BF16_OVERFLOW_BITS) & ~nonfinite
                overflow = int(np.count_nonzero(over))
                # Nonzero magnitudes ≤ 2**-25 become zero: (smag - 1) wraps 0 to 0xFFFF.
                tiny = (smag - np.uint16(1)) < _BF16_UNDERFLOW_MAX_BITS
                self.report.underflow_total += int(np.count_nonzero(tiny))
                if overflow:
                    entry.overflow += overflow
                    biggest = int(smag[over].max()) << 16
                    entry.max_abs = max(entry.max_abs, struct.unpack("<f", struct.pack("<I", biggest))[0])
                    self.report.overflow_total += overflow
                    if self.clamp:
                        out[where[over]] = (special[over] & 0x8000) | _FP16_MAX_BITS
                    elif self.writing:
                        self._stop_writing()
            if self.writing and writer is not None:
                self._wb.write(writer, out.view(np.uint8).data)
            remaining -= len(view)
            self.bytes_done += len(view)
            self._tick(relpath, tensor.name)
        if entry.overflow:
            self.report.overflows.append(entry)

    def _config(self, relpath: str) -> None:
        try:
            config = json.loads((self.src / relpath).read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise InputError("config", f"{relpath} is not valid JSON: {error}") from error
        if not isinstance(config, dict):
            raise InputError("config", f"{relpath} is not a JSON object")
        self.report.config = fp16_config(config)
        self.bytes_done += (self.src / relpath).stat().st_size
        if self.writing:
            f = self._open(relpath)
            writer = _HashingWriter(f)
            self._wb.write(writer, (json.dumps(self.report.config, indent=2) + "\n").encode("utf-8"))
            self._finish(relpath, f, writer)
        self._tick(relpath, "")

    def _copy(self, relpath: str) -> None:
        f = self._open(relpath) if self.writing else None
        writer = _HashingWriter(f) if f is not None else None
        with open(self.src / relpath, "rb") as source:
            while True:
                slot = self._next_slot()
                view = slot[: source.readinto(slot)]
                if not view:
                    break
                if writer is not None:
                    self._wb.write(writer, view)
                self.bytes_done += len(view)
        if f is not None:
            assert writer is not None  # made with f
            self._finish(relpath, f, writer)
        self._tick(relpath, "")


def convert_into(
    src: str | Path,
    work_dir: str | Path,
    *,
    clamp: bool = False,
    progress: ProgressCallback | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> ConversionReport:
    """Convert the model in `src` into `work_dir` (created; must not exist or be empty).

    Raises `Fp16RangeError` (with the full report; `work_dir` then holds nothing
    of the model) when values overflow and `clamp` is false, and `InputError` for
    a directory that cannot be converted. The caller removes `work_dir` on error.
    """
    src, work = Path(src), Path(work_dir)
    plan = plan_dir(src)
    work.mkdir(parents=True, exist_ok=True)
    if any(work.iterdir()):
        raise InputError("output", f"{work} is not empty")
    return _Converter(src, work, plan, clamp=clamp, progress=progress, chunk_bytes=chunk_bytes).run()


def partial_dir(target: str | Path, token: str) -> Path:
    """The hidden work directory beside `target` (same filesystem, so the final rename is atomic)."""
    target = Path(target)
    return target.parent / f".{target.name}{PARTIAL_MARK}{token}"


def remove_partials(target: str | Path, *, keep: str | None = None) -> list[Path]:
    """Delete work directories that earlier (interrupted) conversions to `target` left behind."""
    target = Path(target)
    removed: list[Path] = []
    if not target.parent.is_dir():
        return removed
    prefix = f".{target.name}{PARTIAL_MARK}"
    for entry in target.parent.iterdir():
        if entry.name.startswith(prefix) and entry.name != (f"{prefix}{keep}" if keep else None):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


def check_target(src: str | Path, target: str | Path) -> Path:
    src, target = Path(src).resolve(), Path(target).absolute()
    if target.exists():
        raise InputError("output", f"{target} already exists")
    if target == src or src in target.parents:
        raise InputError("output", "the output must not be inside the source model directory")
    if not target.parent.is_dir():
        raise InputError("output", f"{target.parent} does not exist")
    return target


def fsync_dir(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def convert_model_dir(
    src: str | Path,
    target: str | Path,
    *,
    clamp: bool = False,
    progress: ProgressCallback | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> ConversionReport:
    """Convert `src` to `target`, which appears only once complete (temp dir + rename)."""
    target = check_target(src, target)
    remove_partials(target)
    work = partial_dir(target, uuid.uuid4().hex[:12])
    try:
        report = convert_into(src, work, clamp=clamp, progress=progress, chunk_bytes=chunk_bytes)
        os.rename(work, target)
        fsync_dir(target.parent)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return report
