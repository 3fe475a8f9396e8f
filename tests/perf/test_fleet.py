"""The fleet bench (perf/fleet.py) at a tiny size, so it cannot rot; and page query counts by fleet size."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from perf.fleet import PAGES, build_fleet, page_costs

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # a tiny run of a whole benchmark script: out of make test-fast
def test_a_tiny_fleet_bench_supervises_every_node_prints_its_table_and_cleans_up():
    run = subprocess.run(
        [sys.executable, "-m", "perf.fleet", "--nodes", "5", "--ticks", "1", "--inflight", "50",
         "--concurrency", "2"],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    for row in (r"\| fleet registered \(5 nodes × 8 GPUs, 10 deployments\)", r"\| every node checked after",
                r"\| /nodes/ queries, 3 → 5 nodes +\| +(\d+) → \1 \| same +\| yes \|",
                r"\| routing table refresh, 10 replicas",
                r"\| Redis memory per in-flight request \(50"):  # fmt: skip
        assert re.search(row, run.stdout), row
    assert not re.search(r"\| +NO \|", run.stdout)
    directory = re.search(r"setting up in (\S+)", run.stdout).group(1)
    assert not Path(directory).exists()
    assert directory not in subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout


@pytest.mark.django_db
@pytest.mark.usefixtures("metrics_redis")
def test_the_dashboard_nodes_and_deployments_pages_cost_the_same_queries_for_3_and_for_30_nodes(
    client, alice
):
    client.force_login(alice)
    build_fleet(first=0, count=3)
    small = page_costs(client)
    build_fleet(first=3, count=27)
    large = page_costs(client)
    assert {p: small[p][0] for p in PAGES} == {p: large[p][0] for p in PAGES}
    # And the pages show the whole fleet (the counts did not stay flat by leaving rows out).
    assert "fleet-029" in client.get("/nodes/").content.decode()
    assert "fleet-029-d1" in client.get("/deployments/").content.decode()
