"""The proxy benchmark (perf/proxy_bench.py) at tiny numbers, so it cannot rot."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # a tiny run of a whole benchmark script: out of make test-fast
def test_a_tiny_proxy_bench_runs_one_and_two_processes_clean_and_counts_redis_work(tmp_path):
    out = tmp_path / "proxy.json"
    run = subprocess.run(
        [sys.executable, "-m", "perf.proxy_bench", "--levels", "4", "--workers", "1,2", "--duration", "1",
         "--repeats", "1", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    for row in (r"\| +4 \| direct +\|", r"\| +4 \| gateway ×1 +\|", r"\| +4 \| gateway ×2 +\|"):
        assert re.search(row, run.stdout), row
    results = {r["target"]: r["runs"][0] for r in json.loads(out.read_text())["results"]}
    assert set(results) == {"direct", "gateway-1", "gateway-2"}
    for target, result in results.items():
        assert result["errors"] == 0 and result["requests"] >= 4, target
    for target in ("gateway-1", "gateway-2"):
        # Admission (which writes the open record) and finish (which forgets it): 2 scripts per
        # request (docs/scale.md counts them); a lease renewal now and then adds a fraction.
        assert 2 <= results[target]["redis_scripts_per_request"] < 3
        assert 45 <= results[target]["redis_commands_per_request"] < 60  # 53.2 on 2026-12-04
        assert 1 <= sum(results[target]["connections_per_process"]) <= 4  # sampled halfway through
    # Its throwaway directory is gone.
    setup_line = next(line for line in run.stdout.splitlines() if "setting up in" in line)
    assert not Path(setup_line.rsplit(" ", 1)[1]).exists()


def test_the_proxy_bench_refuses_an_unbounded_worker_count():
    run = subprocess.run(
        [sys.executable, "-m", "perf.proxy_bench", "--workers", "1,99"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 2
    assert "--workers: each between 1 and 16" in run.stderr
