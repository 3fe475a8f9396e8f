"""The `bench` command: its contract (docs/architecture.md#contracts), against the fake server."""

from __future__ import annotations

import io
import json
import re

import pytest
from django.core.management import CommandError, call_command

VLLM_KEYS = [
    "concurrency",
    "completed",
    "failed",
    "output_throughput",
    "request_throughput",
    "mean_ttft_ms",
    "p95_ttft_ms",
    "mean_tpot_ms",
    "p95_tpot_ms",
    "mean_e2el_ms",
    "median_itl_ms",
    "p99_e2el_ms",
]


def bench(*args: str) -> str:
    out = io.StringIO()
    call_command("bench", *args, stdout=out)
    return out.getvalue()


def test_it_prints_the_table_and_writes_vllm_keys(fake_server, tmp_path):
    path = tmp_path / "out.json"
    # fmt: off
    out = bench("--url", fake_server.url, "--model", "llama-2-7b-chat-hf", "--concurrency", "2,4",
                "--requests-per-level", "8", "--mix", "fixed:16:8", "--json", str(path))
    # fmt: on
    lines = out.splitlines()
    assert lines[0].split("|")[0].strip() == "concurrency"
    assert [line.split("|")[0].strip() for line in lines[2:4]] == ["2", "4"]
    assert "SLA (P95 TTFT ≤ 3 s, P95 TPOT ≤ 0.2 s): 4 is the highest level measured" in out
    report = json.loads(path.read_text())
    first = report["levels"][0]
    assert set(VLLM_KEYS) <= set(first)
    assert first["completed"] == 8 and first["concurrency"] == 2
    assert report["sla_concurrency"] == 4
    assert "samples" not in first


def test_it_fails_clearly_for_an_unknown_mix(fake_server):
    with pytest.raises(CommandError, match="unknown mix 'nope'; known: field-mix"):
        bench("--url", fake_server.url, "--model", "m", "--concurrency", "1", "--mix", "nope")


def test_it_fails_clearly_for_an_unreachable_server():
    with pytest.raises(CommandError, match=re.escape("cannot reach http://127.0.0.1:9/v1/models")):
        bench("--url", "http://127.0.0.1:9", "--model", "m", "--concurrency", "1", "--mix", "short-qa")


def test_it_reports_failed_requests_with_their_reason(fake_server_factory):
    flaky = fake_server_factory(fail_every=4)
    out = bench(
        "--url",
        flaky.url,
        "--model",
        "llama-2-7b-chat-hf",
        "--concurrency",
        "2",
        "--requests-per-level",
        "8",
        "--mix",
        "fixed:8:4",
        "--warmup",
        "0",
    )
    assert "failed: HTTP 500" in out
    assert "injected failure" in out
