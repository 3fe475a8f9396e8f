"""The deployment page's production latency charts with the SLA lines, and breaches on the dashboard."""

from __future__ import annotations

import datetime as dt
import re

import pytest
from django.utils import timezone

from portal.benchmarks.models import BenchmarkLevel, BenchmarkRun
from portal.observability.models import LatencyMinute, SlaBreach
from portal.observability.services import latency_rollup_recent
from portal.teams.models import Usage
from tests.helpers import builders

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("metrics_redis")]


@pytest.fixture
def chat(team, llama7b, cpu_node):
    return builders.deployment(
        name="chat", team=team, model_version=llama7b, node=cpu_node, state="serving",
        sla_p95_ttft_s=1.5, sla_p95_tpot_s=0.25,
    )  # fmt: skip


def traffic(deployment, *, minutes: int, ttft_ms: float, now: dt.datetime) -> None:
    """Three requests in each of the last `minutes` complete minutes, then the beat task's rollup."""
    mid_minute = now.replace(second=30, microsecond=0)  # every record well inside its minute
    for m in range(1, minutes + 1):
        for i in range(3):
            Usage.objects.create(
                created_at=mid_minute - dt.timedelta(minutes=m, seconds=i), team=deployment.team,
                deployment=deployment, model="m", status="completed", http_status=200,
                ttft_ms=ttft_ms, duration_ms=ttft_ms + 9 * 50.0, completion_tokens=10, stream=True,
            )  # fmt: skip
    latency_rollup_recent(now=now)


def operating_point(deployment) -> BenchmarkRun:
    run = BenchmarkRun.objects.create(deployment=deployment, mix="short-qa", state="done", sla_concurrency=8)
    results = {"p95_ttft_ms": 900.0, "p95_tpot_ms": 60.0}
    BenchmarkLevel.objects.create(run=run, index=0, concurrency=8, results=results)
    return run


def test_it_charts_production_latency_against_the_sla_and_the_benchmark(client, bob, chat):
    now = timezone.now()
    traffic(chat, minutes=10, ttft_ms=400.0, now=now)
    run = operating_point(chat)
    client.force_login(bob)  # a member of the owning team
    page = client.get("/deployments/chat/").content.decode()
    assert 'id="latency-ttft"' in page and 'id="latency-tpot"' in page and 'id="latency-requests"' in page
    assert 'id="latency-e2e"' in page  # every completed request, streamed or not
    assert "P95 TTFT ≤ 1.5 s, P95 TPOT ≤ 0.25 s" in page
    assert re.search(r'class="ref-line sla-line" data-value="1.5"', page)
    # 50 ms TPOTs under a 0.25 s SLA: the axis follows the data, the SLA is marked above it.
    assert re.search(r'class="ref-line sla-line off-scale" data-value="0.25"', page)
    assert re.search(r'class="ref-line benchmark-line" data-value="0.9"', page)
    assert re.search(r'class="ref-line benchmark-line" data-value="0.06"', page)
    assert f"run #{run.pk}</a> met the SLA up to <strong>8 concurrent" in page
    assert page.count('data-series="P95 TTFT"') == 1
    assert "30 requests, 0 errors in the window." in page


def test_the_day_and_week_windows_merge_minutes_keeping_the_worst_p95(client, alice, chat):
    now = timezone.now()
    traffic(chat, minutes=3, ttft_ms=400.0, now=now)
    LatencyMinute.objects.filter(minute=LatencyMinute.objects.order_by("minute").first().minute).update(
        p95_ttft_ms=2500.0
    )
    client.force_login(alice)
    for window in ("day", "week"):
        page = client.get(f"/deployments/chat/?latency={window}").content.decode()
        assert f"<strong>last {window}</strong>" in page
        assert "9 requests, 0 errors in the window." in page
    from portal.observability.selectors import latency_series

    _start, _end, points = latency_series(chat.pk, window="week", now=now)
    assert sum(p.requests for p in points) == 9
    assert max(p.p95_ttft_ms for p in points) == 2500.0


def test_an_unknown_window_is_a_400_naming_the_parameter(client, alice, chat):
    client.force_login(alice)
    response = client.get("/deployments/chat/?latency=month")
    assert response.status_code == 400
    assert b"latency: must be one of hour, day, week" in response.content


def test_a_deployment_without_traffic_says_so(client, alice, chat):
    client.force_login(alice)
    page = client.get("/deployments/chat/").content.decode()
    assert "No gateway requests to this deployment in the last hour" in page
    assert "No finished benchmark of this deployment found an SLA operating point yet." in page


def test_a_breach_shows_on_the_dashboard_and_the_deployment_page_with_its_start_and_end(client, alice, chat):
    now = timezone.now()
    traffic(chat, minutes=5, ttft_ms=2000.0, now=now)  # five minutes over the 1.5 s SLA
    breach = SlaBreach.objects.get(deployment=chat)
    assert breach.ended_at is None and "P95 TTFT 2.00 s > 1.5 s" in breach.reason
    client.force_login(alice)
    dashboard = client.get("/").content.decode()
    table = dashboard[dashboard.index('id="sla-breaches"') :]
    assert 'href="/deployments/chat/#production-latency">chat</a>' in table[: table.index("</table>")]
    assert re.search(r'id="breaching-count">1\b', dashboard)
    page = client.get("/deployments/chat/").content.decode()
    assert 'class="breach-open"' in page

    later = now + dt.timedelta(minutes=1)
    traffic(chat, minutes=1, ttft_ms=300.0, now=later)  # the next minute is back inside
    breach.refresh_from_db()
    assert breach.ended_at is not None
    dashboard = client.get("/").content.decode()
    assert re.search(r'id="breaching-count">0\b', dashboard)
    assert "breach-open" not in client.get("/deployments/chat/").content.decode()
