"""The usage insert-rate bench (perf/usage_insert_rate.py) at a tiny size, so it cannot rot."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # a tiny run of a whole benchmark script: out of make test-fast
def test_a_tiny_insert_rate_bench_prints_every_method_and_drops_its_database():
    server = os.environ.get("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/portal").rsplit("/", 1)[0]
    run = subprocess.run(
        [sys.executable, "-m", "perf.usage_insert_rate", "--rows", "60", "--repeats", "1",
         "--admin-url", f"{server}/postgres"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"},
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    methods = [
        "usage_flush, COPY → temp table → INSERT ON CONFLICT (now)",
        "usage_flush, bulk_create ON CONFLICT (before)",
        "bulk_create × 500, ON CONFLICT DO NOTHING",
        "COPY × 1000 into the table, no dedup",
        "COPY × 1000 → temp table → INSERT ON CONFLICT",
    ]
    for method in methods:
        assert re.search(rf"\| {re.escape(method)} +\| +[\d,]+ \| +[\d.]+× \|", run.stdout), method
    assert re.search(r"\| rows stored +\| +420 \|", run.stdout)  # 7 methods × 60
    assert re.search(r"\| bytes per row .*\| +[\d,]+ \|", run.stdout)
    name = re.search(r"database (portal_insert_bench_\d+)", run.stdout).group(1)
    with psycopg.connect(f"{server}/postgres") as conn:
        listed = [row[0] for row in conn.execute("SELECT datname FROM pg_database")]
    assert name not in listed


def test_it_refuses_bad_arguments():
    run = subprocess.run([sys.executable, "-m", "perf.usage_insert_rate", "--rows", "0"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert run.returncode != 0 and "--rows" in run.stderr
