"""The rollout benchmark (perf/rollout_bench.py) at tiny numbers, so it cannot rot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # a tiny run of a whole benchmark script: three simulators, a gateway, two rollouts
def test_a_tiny_rollout_bench_promotes_one_version_and_rolls_the_slow_one_back_with_no_failure(tmp_path):
    out = tmp_path / "rollout.json"
    run = subprocess.run(
        [sys.executable, "-m", "perf.rollout_bench", "--clients", "2", "--max-tokens", "4",
         "--steps", "50x6s,100x6s", "--interval-s", "3", "--min-requests", "3", "--bucket-s", "10",
         "--tail-s", "3", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "## promotion 1 (identical version): v1 → v2-good on chat-promote: promoted" in run.stdout
    assert "## automatic roll-back: v1 → v2-slow on chat-rollback: rolled_back" in run.stdout
    assert "| window" in run.stdout and "new share set" in run.stdout
    promotion, rollback = json.loads(out.read_text())["results"]
    for result in (promotion, rollback):
        assert result["failures"] == 0 and result["requests"] > 10, result
    assert promotion["buckets"][-1]["share_set"][1] == 100  # the new version took all of it
    assert sum(b["new_requests"] for b in promotion["buckets"]) > 0
    assert "P95 TPOT" in rollback["reason"]
    # Back at 0 within two measurement intervals (and a tick) of the bad version's first step.
    assert rollback["share_zero_after_breach_s"] <= 2 * 3 + 1.5, rollback
    # Its throwaway directory is gone.
    setup_line = next(line for line in run.stdout.splitlines() if "setting up in" in line)
    assert not Path(setup_line.rsplit(" ", 1)[1]).exists()
