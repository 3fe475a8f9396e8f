"""bf16 → fp16 conversion of safetensors directories, checked against an independent reference.

The files are real safetensors written here by hand (numpy has no bfloat16, so
bf16 tensors are given as their uint16 bit patterns); the expected fp16 bits
come from Python's own IEEE half packing (`struct` format "e"), not numpy.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open

from inference.convert import (
    FP16_MAX,
    Fp16RangeError,
    convert_into,
    convert_model_dir,
    fp16_config,
    partial_dir,
    remove_partials,
)
from inference.errors import InputError
from inference.hashing import hash_model_dir
from inference.safetensors_header import read_header
from tests.helpers.safetensors import (
    CONFIG,
    bf16_bits,
    bf16_tensor,
    expected_fp16_bits,
    fp16_bits_of,
    make_model,
    write_safetensors,
)

# Edges: the largest bf16 below 65504 (exact in fp16), the smallest above (overflows),
# rounding ties, fp16's subnormal range and below it, zeros, inf and NaN.
EDGE_VALUES = [
    0.0,
    -0.0,
    1.0,
    -2.5,
    65280.0,
    -65280.0,
    1.0 + 2**-7,  # needs 8 mantissa bits: exact in fp16
    2.0**-14,  # smallest fp16 normal
    2.0**-24,  # smallest fp16 subnormal
    2.0**-24 * 1.5,  # tie between 2**-24 and 2**-23: to even (2**-23)
    2.0**-25,  # tie between 0 and 2**-24: to even (0), an underflow
    -(2.0**-26),  # becomes -0, an underflow
    2.0**-100,  # far below: zero
    float("inf"),
    float("-inf"),
]
NAN_BITS = [0x7FC0, 0xFFC0, 0x7F81]  # quiet NaN, negative NaN, signalling NaN with a low payload


def test_it_casts_every_edge_value_bit_for_bit(tmp_path):
    bits = [bf16_bits(v) for v in EDGE_VALUES] + NAN_BITS
    src = make_model(tmp_path / "m", {"model.safetensors": {"w": bf16_tensor(bits)}})
    report = convert_model_dir(src, tmp_path / "out")
    got = fp16_bits_of(tmp_path / "out" / "model.safetensors", "w")
    want = [expected_fp16_bits(b) for b in bits]
    assert [hex(g) for g in got[: len(EDGE_VALUES)]] == [hex(w) for w in want[: len(EDGE_VALUES)]]
    # NaN stays NaN with its sign; payloads are not preserved by any cast (quiet NaN out).
    nan_out = got[len(EDGE_VALUES) :]
    assert all((b & 0x7C00) == 0x7C00 and (b & 0x3FF) for b in nan_out)
    assert [b >> 15 for b in nan_out] == [0, 1, 0]
    assert report.overflow_total == 0
    assert report.nonfinite_total == 5  # ±inf and the three NaNs
    assert report.underflow_total == 3  # 2**-25, -2**-26, 2**-100


def test_it_matches_the_reference_on_every_finite_bf16_pattern(tmp_path):
    bits = np.arange(0x10000, dtype=np.uint16)
    finite = bits[(bits & 0x7FFF) < 0x7F80]
    in_range = finite[(finite & 0x7FFF) < 0x4780]
    src = make_model(tmp_path / "m", {"model.safetensors": {"all": bf16_tensor(in_range)}})
    convert_model_dir(src, tmp_path / "out", chunk_bytes=4096)  # many chunks per tensor
    got = fp16_bits_of(tmp_path / "out" / "model.safetensors", "all")
    want = np.array([expected_fp16_bits(int(b)) for b in in_range], dtype=np.uint16)
    assert np.array_equal(got, want)


def test_it_matches_the_reference_on_all_65536_patterns_when_clamping(tmp_path):
    bits = np.arange(0x10000, dtype=np.uint32).astype(np.uint16)
    rng = np.random.default_rng(1)
    rng.shuffle(bits)  # normal and special values interleaved within every chunk
    src = make_model(tmp_path / "m", {"model.safetensors": {"all": bf16_tensor(bits)}})
    report = convert_model_dir(src, tmp_path / "out", clamp=True, chunk_bytes=1000)
    got = fp16_bits_of(tmp_path / "out" / "model.safetensors", "all")
    is_nan = (bits & 0x7FFF) > 0x7F80
    want = np.array([expected_fp16_bits(int(b), clamp=True) for b in bits], dtype=np.uint16)
    assert np.array_equal(got[~is_nan], want[~is_nan])
    assert np.isnan(got[is_nan].view(np.float16)).all()
    assert np.array_equal(got[is_nan] >> 15, bits[is_nan] >> 15)
    assert report.overflow_total == 2 * (0x7F80 - 0x4780)
    assert report.nonfinite_total == 2 * (0x8000 - 0x7F80)
    assert report.underflow_total == 2 * 0x3300


def test_it_stops_with_a_report_when_values_would_overflow(tmp_path):
    big = [bf16_bits(65536.0), bf16_bits(-(2.0**33)), bf16_bits(65280.0)]
    src = make_model(
        tmp_path / "m",
        {
            "model-00001-of-00002.safetensors": {
                "a": bf16_tensor(big),
                "b": bf16_tensor([bf16_bits(1.0)] * 4),
            },
            "model-00002-of-00002.safetensors": {"c": bf16_tensor([bf16_bits(2.0**127)] * 5)},
        },
    )
    work = tmp_path / "work"
    with pytest.raises(Fp16RangeError) as raised:
        convert_into(src, work, chunk_bytes=16)
    report = raised.value.report
    assert report.overflow_total == 7
    assert [(o.file, o.tensor, o.overflow) for o in report.overflows] == [
        ("model-00001-of-00002.safetensors", "a", 2),
        ("model-00002-of-00002.safetensors", "c", 5),
    ]
    assert report.overflows[0].max_abs == pytest.approx(2.0**33)
    assert list(work.iterdir()) == []  # nothing of the model was left written
    assert "65504" in str(raised.value)


def test_it_clamps_when_asked_and_counts_per_tensor(tmp_path):
    bits = [bf16_bits(65536.0), bf16_bits(-131072.0), bf16_bits(65280.0), 0x7F80, 0x7FC0]
    src = make_model(tmp_path / "m", {"model.safetensors": {"w": bf16_tensor(bits)}})
    report = convert_model_dir(src, tmp_path / "out", clamp=True)
    got = fp16_bits_of(tmp_path / "out" / "model.safetensors", "w")
    assert [hex(g) for g in got[:4]] == ["0x7bff", "0xfbff", hex(expected_fp16_bits(bits[2])), "0x7c00"]
    assert np.isnan(got[4:].view(np.float16)).all()  # NaN is never clamped
    assert report.overflow_total == 2
    assert [(o.tensor, o.overflow) for o in report.overflows] == [("w", 2)]
    assert float(got[:1].view(np.float16)[0]) == FP16_MAX


def test_it_copies_other_dtypes_byte_for_byte_and_keeps_the_layout(tmp_path):
    f32 = np.array([1e10, -3.5, np.nan], dtype="<f4")
    i64 = np.array([1, 2, 3, 4], dtype="<i8")
    src = make_model(
        tmp_path / "m",
        {
            "model.safetensors": {
                "embed": bf16_tensor([bf16_bits(0.5)] * 6, shape=(2, 3)),
                "norm": ("F32", (3,), f32.tobytes()),
                "ids": ("I64", (2, 2), i64.tobytes()),
                "empty": ("BF16", (0,), b""),
            }
        },
    )
    report = convert_model_dir(src, tmp_path / "out")
    out = tmp_path / "out" / "model.safetensors"
    with safe_open(str(out), framework="numpy") as f:
        assert f.metadata() == {"format": "pt"}
        assert f.get_tensor("embed").dtype == np.float16
        assert f.get_tensor("embed").shape == (2, 3)
        assert f.get_tensor("norm").tobytes() == f32.tobytes()
        assert f.get_tensor("ids").tobytes() == i64.tobytes()
        assert f.get_tensor("empty").shape == (0,)
    assert (report.tensors_converted, report.tensors_copied) == (2, 2)
    offsets = [(t.name, t.begin, t.end) for t in read_header(src / "model.safetensors").tensors]
    assert [(t.name, t.begin, t.end) for t in read_header(out).tensors] == offsets
    assert [t.dtype for t in read_header(out).tensors] == ["F16", "F32", "I64", "F16"]


def test_it_rewrites_the_dtype_in_config_and_copies_the_tokenizer(tmp_path):
    src = make_model(
        tmp_path / "m",
        {"model.safetensors": {"w": bf16_tensor([0])}},
        config={**CONFIG, "dtype": "bfloat16", "text_config": {"torch_dtype": "bfloat16"}},
        extra={"generation_config.json": b"{}", "model.safetensors.index.json": b'{"weight_map": {}}'},
    )
    report = convert_model_dir(src, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["torch_dtype"] == config["dtype"] == config["text_config"]["torch_dtype"] == "float16"
    assert config["hidden_size"] == 8
    assert report.config == config
    for name in (
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        "model.safetensors.index.json",
    ):
        assert (tmp_path / "out" / name).read_bytes() == (src / name).read_bytes()


def test_it_sets_torch_dtype_where_the_config_had_none():
    assert fp16_config({"model_type": "llama"}) == {"model_type": "llama", "torch_dtype": "float16"}


def test_its_hashes_equal_a_fresh_hash_of_the_output(tmp_path):
    src = make_model(
        tmp_path / "m",
        {
            "model-00001-of-00002.safetensors": {"a": bf16_tensor([1, 2])},
            "model-00002-of-00002.safetensors": {},
        },
        extra={"README.md": b"# hi\n"},
    )
    report = convert_model_dir(src, tmp_path / "out")
    assert report.hashes() == hash_model_dir(tmp_path / "out")


def test_it_reports_progress_up_to_the_totals(tmp_path):
    src = make_model(
        tmp_path / "m", {"model.safetensors": {"a": bf16_tensor([1] * 100), "b": bf16_tensor([2])}}
    )
    seen = []
    report = convert_model_dir(src, tmp_path / "out", progress=seen.append, chunk_bytes=64)
    assert seen[-1].bytes_done == seen[-1].bytes_total == report.bytes_total
    assert seen[-1].tensors_done == seen[-1].tensors_total == 2
    assert [p.bytes_done for p in seen] == sorted(p.bytes_done for p in seen)
    assert len(seen) > 4  # chunks of a tensor report too


def test_it_never_leaves_a_half_written_target(tmp_path):
    src = make_model(tmp_path / "m", {"model.safetensors": {"a": bf16_tensor([1] * 1000)}})

    def boom(progress):
        if progress.bytes_done > 100:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        convert_model_dir(src, tmp_path / "out", progress=boom, chunk_bytes=64)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_a_rerun_removes_what_an_interrupted_run_left(tmp_path):
    src = make_model(tmp_path / "m", {"model.safetensors": {"a": bf16_tensor([1])}})
    stale = partial_dir(tmp_path / "out", "deadbeef")
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half")
    convert_model_dir(src, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m", "out"]
    assert remove_partials(tmp_path / "out") == []


def test_it_refuses_an_existing_target(tmp_path):
    src = make_model(tmp_path / "m", {"model.safetensors": {"a": bf16_tensor([1])}})
    (tmp_path / "out").mkdir()
    with pytest.raises(InputError, match="already exists"):
        convert_model_dir(src, tmp_path / "out")


def test_it_skips_pickled_weights_beside_safetensors_and_refuses_them_alone(tmp_path):
    src = make_model(tmp_path / "m", {"model.safetensors": {"a": bf16_tensor([1])}})
    (src / "original").mkdir()
    (src / "original" / "consolidated.00.pth").write_bytes(b"pickle")
    report = convert_model_dir(src, tmp_path / "out")
    assert report.skipped == ["original/consolidated.00.pth"]
    assert not (tmp_path / "out" / "original").exists()

    only_bin = tmp_path / "bin"
    only_bin.mkdir()
    (only_bin / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(InputError, match=r"no \*\.safetensors weights .*pytorch_model\.bin"):
        convert_model_dir(only_bin, tmp_path / "out2")


@pytest.mark.parametrize(
    "mangle, message",
    [
        (lambda raw: raw[:-2], "does not match its header"),
        (lambda raw: struct.pack("<Q", 1 << 40) + raw[8:], "not plausible"),
        (lambda raw: raw[:8] + b"[" + raw[9:], "not JSON"),
        (lambda raw: b"\x01", "too short"),
    ],
)
def test_it_refuses_a_malformed_shard(tmp_path, mangle, message):
    src = make_model(tmp_path / "m", {"model.safetensors": {"a": bf16_tensor([1, 2, 3])}})
    path = src / "model.safetensors"
    path.write_bytes(mangle(path.read_bytes()))
    with pytest.raises(InputError, match=message):
        convert_model_dir(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_it_refuses_a_header_whose_sizes_do_not_match_shapes(tmp_path):
    path = tmp_path / "bad.safetensors"
    write_safetensors(path, {"a": ("BF16", (3,), b"\0\0" * 2)})
    with pytest.raises(InputError, match="size does not match"):
        read_header(path)


VLLM_PYTHON = Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"
TORCH_SCRIPT = """
import sys, torch
from safetensors.torch import load_file, save_file
src, out = sys.argv[1], sys.argv[2]
if sys.argv[3] == "write":
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1 << 20, generator=g) * torch.logspace(-12, 4, 1 << 20)  # 1e-12 .. 1e4
    x[:4] = torch.tensor([float("inf"), float("-inf"), float("nan"), 65280.0])
    tensors = {"w": x.to(torch.bfloat16), "f": torch.arange(5, dtype=torch.float32)}
    save_file(tensors, src + "/model.safetensors")
else:
    a, b = load_file(src + "/model.safetensors"), load_file(out + "/model.safetensors")
    want, got = a["w"].to(torch.float16), b["w"]
    assert got.dtype == torch.float16 and torch.equal(b["f"], a["f"])
    same = (want.view(torch.int16) == got.view(torch.int16)) | (want.isnan() & got.isnan())
    assert bool(same.all()), int((~same).sum())
    print("ok")
"""


@pytest.mark.vllm  # torch from the vLLM install, not the engine
@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="needs torch from .venv-vllm")
def test_it_agrees_with_torch_bit_for_bit(tmp_path):
    """torch (from the vLLM venv) writes bf16 and judges our output against its own `.to(float16)`."""
    import subprocess

    src = tmp_path / "m"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(CONFIG))
    subprocess.run([VLLM_PYTHON, "-c", TORCH_SCRIPT, src, tmp_path / "out", "write"], check=True)
    report = convert_model_dir(src, tmp_path / "out")
    assert report.nonfinite_total == 3 and report.underflow_total > 0
    result = subprocess.run(
        [VLLM_PYTHON, "-c", TORCH_SCRIPT, src, tmp_path / "out", "check"],
        check=True,
        capture_output=True,
        text=True,
    )
    assert result.stdout.strip() == "ok"
