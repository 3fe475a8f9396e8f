"""Benchmark pages in headless Chromium: a run page with its plots, and an imported table's verdicts."""

from __future__ import annotations

import pytest
from playwright.sync_api import Page, expect

from tests.helpers.browser import login, shot

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def measured_run(user, deployment):
    from portal.benchmarks.models import BenchmarkLevel, BenchmarkRun, RunState
    from portal.benchmarks.services import BenchmarkRunRequest, benchmark_run_create

    run = benchmark_run_create(
        user=user,
        run_request=BenchmarkRunRequest(
            deployment=deployment, mix="short-qa", concurrencies=[16, 32, 64], requests_per_level=64
        ),
    )
    for index, (concurrency, throughput, ttft, tpot) in enumerate(
        [(16, 900, 700, 45), (32, 1500, 1500, 70), (64, 2000, 3400, 120)]
    ):
        results = {
            "concurrency": concurrency,
            "completed": 64,
            "failed": 0,
            "output_throughput": throughput,
            "median_ttft_ms": ttft * 0.6,
            "p95_ttft_ms": ttft,
            "mean_ttft_ms": ttft * 0.7,
            "median_tpot_ms": tpot * 0.8,
            "p95_tpot_ms": tpot,
            "mean_tpot_ms": tpot * 0.85,
            "little_law": {
                "ok": True,
                "ratio": 0.98,
                "measured_output_throughput": throughput,
                "expected_output_throughput": throughput / 0.98,
            },
            "errors": {},
        }
        samples = {
            "ttft_ms": [ttft * f for f in (0.3, 0.5, 0.6, 0.7, 0.8, 1.0)],
            "tpot_ms": [tpot * f for f in (0.6, 0.8, 0.9, 1.0)],
        }
        BenchmarkLevel.objects.create(
            run=run, index=index, concurrency=concurrency, results=results, samples=samples
        )
    BenchmarkRun.objects.filter(pk=run.pk).update(
        state=RunState.DONE,
        sla_concurrency=32,
        sla_reason="32 is the highest level meeting the SLA; 64 misses: P95 TTFT 3.40 s > 3 s",
    )
    return run


def test_it_shows_a_run_page_with_its_plots(page: Page, live_server, alice, team, llama7b, profile_tp8, dgx):
    from tests.helpers.builders import make_serving_deployment

    deployment = make_serving_deployment(
        team=team, model=llama7b, profile=profile_tp8, node=dgx, url="http://127.0.0.1:9"
    )
    run = measured_run(alice, deployment)
    login(page, live_server, "alice", "alice-password", next_path=run.get_absolute_url())

    expect(page.get_by_role("heading", name=f"Benchmark run #{run.pk}")).to_be_visible()
    plots = page.locator("svg.plot")
    expect(plots).to_have_count(5)
    expect(page.get_by_role("img", name="Output throughput vs concurrency")).to_be_visible()
    expect(page.get_by_role("img", name="TTFT vs concurrency")).to_contain_text("SLA P95 TTFT 3 s")
    expect(page.get_by_role("img", name="TPOT vs concurrency")).to_contain_text("SLA P95 TPOT 0.2 s")
    expect(page.locator("#sla-verdict")).to_contain_text("64 misses: P95 TTFT 3.40 s > 3 s")
    box = plots.first.bounding_box()
    assert box is not None and box["width"] > 300 and box["height"] > 150
    shot(page, "benchmark-run")

    page.get_by_role("link", name="16", exact=True).click()
    expect(page.get_by_role("img", name="TTFT distribution, level 16")).to_be_visible()

    page.get_by_role("button", name=f"Apply 32 as {deployment.name}'s gateway cap").click()
    expect(page.get_by_role("heading", name=f"Deployment {deployment.name}")).to_be_visible()
    expect(page.locator(".cap-source")).to_contain_text(f"benchmark run {run.pk}")


def test_it_imports_the_field_notes_table_and_shows_why_it_fails_littles_law(page: Page, live_server, alice):
    login(page, live_server, "alice", "alice-password", next_path="/benchmarks/import/")
    page.get_by_role("button", name="Import").click()

    expect(page.locator("#sla-verdict")).to_contain_text("Concurrency 64")
    expect(page.locator("#sla-verdict")).to_contain_text("128 misses: P95 TTFT 3.20 s > 3 s")
    expect(page.locator("td.little.suspect")).to_have_count(5)
    expect(page.locator("td.little.suspect").first).to_contain_text(
        "can emit at most ~381 tok/s, yet 1380 tok/s is reported"
    )
    expect(page.locator("svg.plot")).to_have_count(3)
    shot(page, "benchmark-imported-field-notes")
