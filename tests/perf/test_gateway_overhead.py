"""The gateway overhead script (perf/gateway_overhead.py) at tiny numbers, so it cannot rot."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from perf.nginx_relay import nginx_binary

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # a tiny run of a whole benchmark script: out of make test-fast
def test_a_tiny_gateway_overhead_run_prints_the_comparison_and_the_steps(tmp_path):
    out = tmp_path / "overhead.json"
    run = subprocess.run(
        [sys.executable, "-m", "perf.gateway_overhead", "--levels", "1,2", "--rounds", "1", "--duration", "1",
         "--step-requests", "10", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    for row in ("added P50 time to first chunk", "added time per relayed chunk", "throughput ÷ direct",
                "CPU, cores: gateway process", "floor: added P50 time to first chunk",
                "floor: added time per relayed chunk"):  # fmt: skip
        assert re.search(rf"\| {re.escape(row)}[^|]*\|[^|]*\d[^|]*\|[^|]*\d", run.stdout), row
    result = json.loads(out.read_text())
    assert result["summary"]["1"]["errors"] == 0 and result["summary"]["2"]["errors"] == 0
    for level in ("1", "2"):
        for target in ("direct", "gateway", "floor"):  # nginx too where the machine has it
            assert result["rounds"][level][0][target]["requests"] >= 1
    if nginx_binary():  # the C relay's rows, where this machine has nginx (CI's does not)
        assert re.search(r"\| nginx: added time per relayed chunk, ms[^|]*\|[^|]*\d", run.stdout)
        assert result["rounds"]["1"][0]["nginx"]["requests"] >= 1
    # The instrumented gateway timed every step of a streamed request's path.
    steps = result["steps"]
    for step in ("ASGI entry", "authentication", "parsing", "route", "counting", "admission",
                 "upstream connect", "per-chunk relay", "accounting"):  # fmt: skip
        assert steps[step]["samples"] >= 10 and steps[step]["median_us"] > 0, step
        assert re.search(rf"\| {re.escape(step)} +\| +\d+ \| +\d* \|", run.stdout), step
    setup_line = next(line for line in run.stdout.splitlines() if "setting up in" in line)
    assert not Path(setup_line.rsplit(" ", 1)[1]).exists()


def test_the_step_timing_is_off_unless_asked_for():
    from portal.gateway import timing

    assert timing.ON is False  # the tests' gateways, like production, time nothing
