"""Production latency in Chromium: the deployment page's charts with the SLA and benchmark lines, the
window switch, and a breach on the ops dashboard."""

from __future__ import annotations

import datetime as dt
import math

import pytest
from django.utils import timezone
from playwright.sync_api import Page, expect

from portal.benchmarks.models import BenchmarkLevel, BenchmarkRun
from portal.deployments.models import Deployment
from portal.observability.services import latency_rollup_recent
from portal.teams.models import Usage
from tests.helpers.browser import login, shot

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.browser]


@pytest.fixture
def busy(team, llama7b, cpu_node):
    """An hour of traffic whose TTFT climbs over the 3 s SLA for the last 8 minutes, rolled up."""
    deployment = Deployment.objects.create(
        name="chat-prod", team=team, model_version=llama7b, node=cpu_node, state="serving"
    )
    mid_minute = timezone.now().replace(second=30, microsecond=0)
    rows = []
    for m in range(1, 61):
        ttft = 4200.0 if m <= 8 else 900.0 + 400 * math.sin(m / 6)
        for i in range(4):
            rows.append(
                Usage(
                    created_at=mid_minute - dt.timedelta(minutes=m, seconds=i),
                    team=team,
                    deployment=deployment,
                    model=llama7b.name,
                    status="completed",
                    http_status=200,
                    ttft_ms=ttft + 50 * i,
                    duration_ms=ttft + 63 * (60 + 5 * i),
                    completion_tokens=64,
                    stream=True,
                )
            )
    Usage.objects.bulk_create(rows)
    latency_rollup_recent(now=mid_minute - dt.timedelta(minutes=31))  # the older half
    latency_rollup_recent(now=mid_minute)
    run = BenchmarkRun.objects.create(deployment=deployment, mix="short-qa", state="done", sla_concurrency=16)
    BenchmarkLevel.objects.create(
        run=run, index=0, concurrency=16, results={"p95_ttft_ms": 1800.0, "p95_tpot_ms": 95.0}
    )
    return deployment


def test_ops_see_production_latency_against_the_sla_and_the_breach(page: Page, live_server, alice, busy):
    login(page, live_server, "alice", "alice-password")
    breaches = page.locator("#sla-breaches")
    expect(breaches).to_contain_text("chat-prod")
    expect(breaches).to_contain_text("P95 TTFT")

    breaches.get_by_role("link", name="chat-prod").click()
    ttft = page.locator("svg#latency-ttft")
    expect(ttft).to_be_visible()
    expect(ttft.locator("polyline.series").first).to_be_visible()
    expect(ttft.locator("line.sla-line")).to_have_attribute("data-value", "3")
    expect(ttft.locator("line.benchmark-line")).to_have_attribute("data-value", "1.8")
    tpot = page.locator("svg#latency-tpot")
    expect(tpot.locator("line.sla-line")).to_have_attribute("data-value", "0.2")
    expect(tpot.locator("line.benchmark-line")).to_have_attribute("data-value", "0.095")
    expect(page.locator("svg#latency-requests")).to_be_visible()
    expect(page.locator(".sla-breaches tr.breach-open")).to_contain_text("breaching")
    # The SLA line is drawn inside the plot, below the breaching P95 points (higher y is lower).
    sla_y = float(ttft.locator("line.sla-line").get_attribute("y1"))
    assert 24 <= sla_y <= 190
    assert ttft.locator("line.sla-line").bounding_box()["width"] > 600
    shot(page, "production-latency-hour")

    page.get_by_role("link", name="last week").click()
    expect(page.locator(".latency-windows strong")).to_have_text("last week")
    week_sla = page.locator("svg#latency-ttft line.sla-line")
    expect(week_sla).to_have_attribute("data-value", "3")
    assert week_sla.bounding_box()["width"] > 600  # drawn across the plot (a flat line has no height)
    expect(page.locator(".production-latency")).to_contain_text("240 requests, 0 errors in the window.")
    shot(page, "production-latency-week")
