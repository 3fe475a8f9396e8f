"""The batch benchmark (perf/batch_spare_capacity.py) at tiny numbers, so it cannot rot.
No timing assertions: the machine's load decides those; the table and the batch's work must be there."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # a tiny run of a whole benchmark script: out of make test-fast
def test_a_tiny_batch_bench_runs_both_phases_and_the_batch_finishes_lines(tmp_path):
    out = tmp_path / "batch.json"
    run = subprocess.run(
        [sys.executable, "-m", "perf.batch_spare_capacity", "--lines", "300", "--speedup", "5",
         "--interactive-rate", "3", "--duration", "2", "--rounds", "1", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    for row in (r"\| interactive alone +\|", r"\| interactive with batch +\|", r"goal: .* ≤ 1\.10 × alone"):
        assert re.search(row, run.stdout), row
    (result,) = json.loads(out.read_text())["rounds"]
    alone, mixed = result["alone"], result["with batch"]
    assert alone["interactive_requests"] >= 1 and alone["interactive_errors"] == 0
    assert mixed["interactive_requests"] == alone["interactive_requests"]  # the same seeded schedule
    assert mixed["batch_lines"] >= 1 and mixed["batch_lines_s"] > 0


def test_the_batch_bench_refuses_a_batch_too_large():
    run = subprocess.run(
        [sys.executable, "-m", "perf.batch_spare_capacity", "--lines", "100001"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 2
    assert "--lines: between 1 and 100000" in run.stderr
