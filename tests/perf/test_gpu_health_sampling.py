"""The GPU health sampling bench (perf/gpu_health_sampling.py) at a tiny size, so it cannot rot."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_it_prints_the_cost_of_a_sample_per_step():
    run = subprocess.run(
        [sys.executable, "-m", "perf.gpu_health_sampling", "--repeats", "3"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "8 GPUs from health_v100_sxm2_8x_throttling.csv" in run.stdout
    for step in ("parse + rules", "read_sample via fake nvidia-smi + dmesg"):
        assert step in run.stdout
