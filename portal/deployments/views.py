"""Pages for profiles, deployments and the planner."""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.http import HttpResponseBadRequest
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.utils import timezone
from django.utils.http import urlencode
from django.views.decorators.http import require_POST

from inference.rules import finding_title
from portal.core.errors import ApplicationError
from portal.inventory.models import Node
from portal.observability.charts import Line, time_series_svg
from portal.observability.selectors import (
    LATENCY_WINDOWS,
    benchmark_operating_point,
    latency_series,
    sla_breaches,
)

from . import services
from .forms import PlannerForm
from .models import DeploymentProfile, DeploymentState
from .selectors import deployment_get_for_user, deployment_text_for, deployments_visible_to
from .sparklines import rates, sparkline

# States in which the page refreshes itself quickly, to show the steps as they happen.
TRANSITIONAL = {
    DeploymentState.PENDING,
    DeploymentState.STARTING,
    DeploymentState.DRAINING,
    DeploymentState.STOPPING,
}


def _plan_or_error(compute):
    """(plan dict, None) or (None, error message): a page shows either."""
    try:
        plan = compute()
    except ApplicationError as error:
        return None, f"{error.field}: {error.message}" if error.field else error.message
    return (plan.to_dict() if plan is not None else None), None


@login_required
def profile_list(request):
    profiles = DeploymentProfile.objects.select_related("model_version")
    rows = []
    for profile in profiles:
        plan = _plan_or_error(lambda p=profile: services.profile_plan(p))[0]
        # Short names with the message on hover: the codes alone mean nothing to a reader.
        findings = [
            {"level": f["level"], "title": finding_title(f["code"]), "message": f["message"]}
            for f in (plan["findings"] if plan else [])
            if f["level"] in ("error", "warning")
        ]
        rows.append((profile, plan, findings))
    return render(request, "deployments/profile_list.html", {"rows": rows})


@login_required
def profile_detail(request, name: str):
    profile = get_object_or_404(DeploymentProfile.objects.select_related("model_version"), name=name)
    plan, error = _plan_or_error(lambda: services.profile_plan(profile))
    return render(
        request,
        "deployments/profile_detail.html",
        {
            "profile": profile,
            "plan": plan,
            "plan_error": error,
            "deployments": deployments_visible_to(request.user).filter(profile=profile),
        },
    )


@login_required
def deployment_list(request):
    return render(
        request, "deployments/deployment_list.html", {"deployments": deployments_visible_to(request.user)}
    )


@login_required
def deployment_detail(request, name: str):
    deployment = deployment_get_for_user(request.user, name)
    window = request.GET.get("latency", "hour")
    if window not in LATENCY_WINDOWS:
        return HttpResponseBadRequest(f"latency: must be one of {', '.join(LATENCY_WINDOWS)}")
    plan, error = _plan_or_error(lambda: services.deployment_plan(deployment))
    events = list(deployment.events.order_by("-at", "-id")[:100])[::-1]
    for e in events:  # shown, never saved
        e.message = deployment_text_for(request.user, deployment, e.message, step=e.step)
    deployment.state_reason = deployment_text_for(request.user, deployment, deployment.state_reason)
    return render(
        request,
        "deployments/deployment_detail.html",
        {
            "deployment": deployment,
            "plan": plan,
            "plan_error": error,
            "events": events,
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

    box = {"times": times, "start": start, "end": end}
    charts = [
        time_series_svg(
            **box,
            series={
                "P95 TTFT": seconds([p.p95_ttft_ms for p in points]),
                "P50 TTFT": seconds([p.p50_ttft_ms for p in points]),
            },
            title="Time to first token (s)",
            unit="s",
            lines=lines(deployment.sla_p95_ttft_s, point and point.p95_ttft_ms, "TTFT"),
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
            lines=lines(deployment.sla_p95_tpot_s, point and point.p95_tpot_ms, "TPOT"),
            chart_id="latency-tpot",
        ),
        time_series_svg(
            **box,
            series={"requests": [p.requests for p in points], "errors": [p.errors for p in points]},
            title=f"Requests and errors per {LATENCY_WINDOWS[window][1]} min",
            unit="",
            chart_id="latency-requests",
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


@login_required
@require_POST
def deployment_action(request, name: str, action: str):
    """Start, stop or restart from the deployment page (staff only)."""
    deployment = deployment_get_for_user(request.user, name)
    if not request.user.is_staff:
        raise PermissionDenied
    service = {
        "start": services.deployment_request_start,
        "stop": services.deployment_request_stop,
        "restart": services.deployment_request_restart,
    }.get(action)
    if service is None:
        raise PermissionDenied
    try:
        service(deployment=deployment, user=request.user)
    except ApplicationError as error:
        messages.error(request, error.message)
    else:
        messages.success(request, f"{action} requested: the agent on {deployment.node.name} is on it")
    return redirect(deployment)


@login_required
def planner(request):
    """Try a model × profile × GPUs without saving anything (GET, so results can be linked)."""
    plan, error, profile_link = None, None, None
    if "model" in request.GET:
        form = PlannerForm(request.GET)
        if form.is_valid():
            plan, error = _plan_or_error(lambda: _plan_from_form(form))
            query = form.profile_query() if plan and plan["ok"] and request.user.is_staff else None
            if query is not None:
                profile_link = f"{reverse('admin:deployments_deploymentprofile_add')}?{urlencode(query)}"
    else:
        profile = DeploymentProfile.objects.filter(name=request.GET.get("profile", "")).first()
        node = Node.objects.filter(name=request.GET.get("node", "")).first()
        initial = PlannerForm.initial_from_profile(profile) if profile else {}
        if node is not None:
            initial.update(PlannerForm.initial_from_node(node))
        form = PlannerForm(initial=initial)
    return render(
        request,
        "deployments/planner.html",
        {"form": form, "plan": plan, "plan_error": error, "profile_link": profile_link},
    )


def _plan_from_form(form: PlannerForm):
    return services.plan_on_catalog_gpus(**form.target_values(), **form.settings_values())
