"""The priority-class benchmark (perf/priority_classes.py) at tiny numbers, so it cannot rot.
No timing assertions: the machine's load decides those; the table and the counts must be there."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # a tiny run of a whole benchmark script: out of make test-fast
def test_a_tiny_priority_bench_runs_both_phases_and_batch_completes_work(tmp_path):
    out = tmp_path / "priority.json"
    run = subprocess.run(
        [sys.executable, "-m", "perf.priority_classes", "--cap", "4", "--batch-clients", "4",
         "--interactive-rate", "5", "--duration", "1", "--repeats", "1", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    for row in (r"\| interactive alone +\|", r"\| interactive with batch +\|", r"target: .* ≤ 1\.10 × alone"):
        assert re.search(row, run.stdout), row
    result = json.loads(out.read_text())
    alone, mixed = result["runs"]["alone"][0], result["runs"]["with batch"][0]
    assert alone["interactive_requests"] >= 1 and alone["interactive_errors"] == 0
    assert mixed["interactive_requests"] == alone["interactive_requests"]  # the same seeded schedule
    assert alone["batch_completed"] == 0
    assert mixed["batch_completed"] >= 1 and mixed["batch_errors"] == 0
    setup_line = next(line for line in run.stdout.splitlines() if "setting up in" in line)
    assert not Path(setup_line.rsplit(" ", 1)[1]).exists()


def test_the_priority_bench_refuses_a_share_outside_zero_to_one():
    run = subprocess.run(
        [sys.executable, "-m", "perf.priority_classes", "--share", "1.5"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 2
    assert "--share: above 0 and at most 1" in run.stderr
