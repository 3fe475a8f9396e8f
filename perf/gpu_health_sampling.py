"""What one GPU health sample costs a node agent (inference/gpu_health/), 8 GPUs from the fixtures.

    .venv/bin/python -m perf.gpu_health_sampling [--repeats 200] [--fixture health_….csv]

Per sample, median and P95 of `--repeats`, in ms:
- parse: the 8-GPU `nvidia-smi --query-gpu` text into typed readings;
- rules: `evaluate` for each of the 8 GPUs (kernel-log Xid lines included);
- parse + rules: what the agent adds to a sample beyond running the commands;
- fake nvidia-smi: `read_sample` through a real subprocess (a script that prints the fixture),
  i.e. fork/exec of two commands, the timeout machinery, parse; rules not included.
With `--real`, also `read_sample` on this machine's own nvidia-smi and dmesg, plus the rules: the
driver's own time (NVML start-up: milliseconds with persistence mode on, seconds without).
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import tempfile
import time
from pathlib import Path

from inference.gpu_health import GpuContext, Sample, evaluate, parse_health_csv, parse_kernel_log, read_sample

from ._common import ROOT, table

FIXTURES = ROOT / "inference" / "data" / "nvidia_smi"


def _ms(samples: list[float]) -> tuple[str, str]:
    ordered = sorted(samples)
    p95 = ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]
    return f"{statistics.median(ordered) * 1000:.3f}", f"{p95 * 1000:.3f}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--fixture", default="health_v100_sxm2_8x_throttling.csv")
    parser.add_argument("--real", action="store_true", help="also time this machine's own nvidia-smi")
    args = parser.parse_args(argv)
    if not 1 <= args.repeats <= 100_000:
        parser.error("--repeats must be between 1 and 100000")
    text = (FIXTURES / args.fixture).read_text()
    log = (FIXTURES / "kernel_log_xid_dmesg_iso.txt").read_text()
    now = dt.datetime(2026, 12, 2, 3, 30, tzinfo=dt.UTC)
    parse_s, rules_s, both_s, exec_s = [], [], [], []
    for _ in range(args.repeats):
        began = time.perf_counter()
        gpus = tuple(parse_health_csv(text))
        xids = tuple(parse_kernel_log(log))
        parsed = time.perf_counter()
        sample = Sample(at=now, gpus=gpus, xids=xids)
        for gpu in gpus:
            evaluate(GpuContext(gpu.index, gpu.pci_bus_id), sample)
        done = time.perf_counter()
        parse_s.append(parsed - began)
        rules_s.append(done - parsed)
        both_s.append(done - began)
    real_s: list[float] = []
    real_gpus = 0
    if args.real:  # before the fake goes on PATH
        for _ in range(min(args.repeats, 50)):
            began = time.perf_counter()
            sampled = read_sample(timeout_s=30)
            real_s.append(time.perf_counter() - began)
            if sampled.unavailable or sampled.error:
                raise SystemExit(f"no real sample: {sampled.error or 'nvidia-smi is not installed'}")
            sample = Sample(at=sampled.at, gpus=sampled.gpus, xids=sampled.xids)
            for gpu in sampled.gpus:
                evaluate(GpuContext(gpu.index, gpu.pci_bus_id), sample)
            real_gpus = len(sampled.gpus)
    with tempfile.TemporaryDirectory() as bin_dir:
        for name, source in (("nvidia-smi", args.fixture), ("dmesg", "kernel_log_xid_dmesg_iso.txt")):
            script = Path(bin_dir) / name
            script.write_text(f"#!/bin/sh\nexec cat {FIXTURES / source}\n")
            script.chmod(0o755)
        os.environ["PATH"] = f"{bin_dir}{os.pathsep}{os.environ['PATH']}"
        for _ in range(min(args.repeats, 50)):
            began = time.perf_counter()
            sampled = read_sample(timeout_s=10)
            exec_s.append(time.perf_counter() - began)
            assert len(sampled.gpus) == len(gpus), sampled.error
    rows = [
        ["parse (8 GPUs + kernel log)", *_ms(parse_s)],
        ["rules (8 GPUs)", *_ms(rules_s)],
        ["parse + rules", *_ms(both_s)],
        ["read_sample via fake nvidia-smi + dmesg", *_ms(exec_s)],
    ]
    if real_s:
        rows.append([f"real nvidia-smi + dmesg + rules ({real_gpus} GPUs)", *_ms(real_s)])
    print(f"GPU health sample, {len(gpus)} GPUs from {args.fixture}, {args.repeats} repeats")
    print(table(["step", "median ms", "P95 ms"], rows))


if __name__ == "__main__":
    main()
