"""Observability pages: `/metrics` for a scraper, and a deployment's own page, which shows its
production latency against its SLA beside what deployments know (plan, timeline, samples). The
page reads deployments and benchmarks, which sit below this app, so it lives here."""

from __future__ import annotations

import hashlib
import hmac
from typing import Any

from django.conf import settings
from django.contrib.auth.decorators import login_required
from django.http import Http404, HttpResponse, HttpResponseBadRequest
from django.shortcuts import render
from django.utils import timezone
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET
from prometheus_client import CONTENT_TYPE_LATEST

from portal.core.charts import Line, rates, sparkline, time_series_svg
from portal.deployments import services as deployment_services
from portal.deployments.models import DeploymentState
from portal.deployments.selectors import deployment_get_for_user, deployment_text_for, pending_unclaimed_note
from portal.deployments.views import plan_or_error

from .collector import exposition
from .selectors import LATENCY_WINDOWS, benchmark_operating_point, latency_series, sla_breaches

# States in which the page refreshes itself quickly, to show the steps as they happen.
TRANSITIONAL = {
    DeploymentState.PENDING,
    DeploymentState.STARTING,
    DeploymentState.DRAINING,
    DeploymentState.STOPPING,
}


def _token_matches(given: str, expected: str) -> bool:
    # Digests first, so the comparison takes the same time whatever the lengths.
    digest = hashlib.sha256
    return hmac.compare_digest(digest(given.encode()).digest(), digest(expected.encode()).digest())


@never_cache
@require_GET
def metrics(request):
    expected = settings.PORTAL_METRICS_TOKEN
    if not expected:
        raise Http404("Metrics are off (PORTAL_METRICS_TOKEN is not set).")
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not _token_matches(given.strip(), expected):
        response = HttpResponse("A valid metrics token is required.\n", status=401, content_type="text/plain")
        response["WWW-Authenticate"] = 'Bearer realm="metrics"'
        return response
    return HttpResponse(exposition(), content_type=CONTENT_TYPE_LATEST)


@login_required
def deployment_detail(request, name: str):
    deployment = deployment_get_for_user(request.user, name)
    window = request.GET.get("latency", "hour")
    if window not in LATENCY_WINDOWS:
        return HttpResponseBadRequest(f"latency: must be one of {', '.join(LATENCY_WINDOWS)}")
    plan, error = plan_or_error(lambda: deployment_services.deployment_plan(deployment))
    events = list(deployment.events.order_by("-at", "-id")[:100])[::-1]
    for e in events:  # shown, never saved
        e.message = deployment_text_for(request.user, deployment, e.message, step=e.step)
    deployment.state_reason = deployment_text_for(request.user, deployment, deployment.state_reason)
    unclaimed = pending_unclaimed_note(
        deployment, last_event_at=events[-1].at if events else None, now=timezone.now()
    )
    return render(
        request,
        "observability/deployment_detail.html",
        {
            "deployment": deployment,
            "plan": plan,
            "plan_error": error,
            "events": events,
            "unclaimed": unclaimed,
            "charts": _charts(deployment),
            "latency": _latency(deployment, window),
            "refresh_s": 3 if deployment.state in TRANSITIONAL else 30,
        },
    )


def _latency(deployment, window: str) -> dict:
    """Production latency per minute over the window (issue 16), against the deployment's SLA and
    the P95s its latest benchmark measured at the SLA operating point."""
    start, end, points = latency_series(deployment.pk, window=window, now=timezone.now())
    point = benchmark_operating_point(deployment.pk)
    times = [p.start for p in points]

    def lines(sla_s: float, bench_ms: float | None, name: str) -> list[Line]:
        out = [Line(sla_s, f"SLA P95 {name} {sla_s:g} s", "sla")]
        if point is not None and bench_ms is not None:
            label = f"benchmark P95 {bench_ms / 1000:.3g} s at {point.concurrency} concurrent"
            out.append(Line(bench_ms / 1000, label, "benchmark"))
        return out

    def seconds(values: list[float | None]) -> list[float | None]:
        return [None if v is None else v / 1000 for v in values]

    box: dict[str, Any] = {"times": times, "start": start, "end": end}
    charts = [
        time_series_svg(
            **box,
            series={
                "P95 TTFT": seconds([p.p95_ttft_ms for p in points]),
                "P50 TTFT": seconds([p.p50_ttft_ms for p in points]),
            },
            title="Time to first token (s)",
            unit="s",
            lines=lines(deployment.sla_p95_ttft_s, point.p95_ttft_ms if point else None, "TTFT"),
            chart_id="latency-ttft",
        ),
        time_series_svg(
            **box,
            series={
                "P95 TPOT": seconds([p.p95_tpot_ms for p in points]),
                "P50 TPOT": seconds([p.p50_tpot_ms for p in points]),
            },
            title="Time per output token (s)",
            unit="s",
            lines=lines(deployment.sla_p95_tpot_s, point.p95_tpot_ms if point else None, "TPOT"),
            chart_id="latency-tpot",
        ),
        time_series_svg(
            **box,
            series={
                "P95 end-to-end": seconds([p.p95_e2e_ms for p in points]),
                "P50 end-to-end": seconds([p.p50_e2e_ms for p in points]),
            },
            # Every completed request, streamed or not (non-streamed ones have no TTFT or TPOT).
            title="End-to-end latency, arrival to last byte (s)",
            unit="s",
            chart_id="latency-e2e",
        ),
        time_series_svg(
            **box,
            series={"requests": [p.requests for p in points], "errors": [p.errors for p in points]},
            title=f"Requests and errors per {LATENCY_WINDOWS[window][1]} min",
            unit="",
            chart_id="latency-requests",
            colors=("#1f6feb", "#cf222e"),
        ),
    ]
    return {
        "window": window,
        "windows": list(LATENCY_WINDOWS),
        "step_minutes": LATENCY_WINDOWS[window][1],
        "charts": charts if points else [],
        "requests": sum(p.requests for p in points),
        "errors": sum(p.errors for p in points),
        "operating_point": point,
        "breaches": sla_breaches(deployment_id=deployment.pk, limit=10),
    }


def _charts(deployment) -> list[dict]:
    """Sparklines of the last samples: running/waiting requests, KV usage, tokens/s, memory."""
    samples = list(deployment.samples.order_by("-at")[:60])[::-1]
    if not samples:
        return []
    seconds = [s.at.timestamp() for s in samples]
    series = {
        "running requests": [s.running for s in samples],
        "waiting requests": [s.waiting for s in samples],
        "KV-cache usage (%)": [None if s.kv_cache_usage is None else s.kv_cache_usage * 100 for s in samples],
        "generated tokens/s": rates([s.generation_tokens for s in samples], seconds),
        "memory (MiB)": [s.memory_mb for s in samples],
    }
    charts = []
    for label, values in series.items():
        last = next((v for v in reversed(values) if v is not None), None)
        charts.append({"label": label, "svg": sparkline(values, label=label), "last": last})
    return charts
