"""Benchmark pages: history (per deployment, per profile, filterable), a run with plots, compare, export."""

from __future__ import annotations

import json

from django.contrib import messages
from django.contrib.admin.views.decorators import staff_member_required
from django.contrib.auth.decorators import login_required
from django.http import Http404, HttpResponse, JsonResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.utils.http import url_has_allowed_host_and_scheme
from django.views.decorators.http import require_POST

from inference.loadgen.workloads import PRESETS
from portal.core.charts import histogram, run_plots, safe_svg
from portal.core.errors import ApplicationError
from portal.core.filters import filtered
from portal.deployments.models import DeploymentProfile
from portal.deployments.selectors import (
    acceptance_deployment_q,
    acceptance_profile_q,
    deployment_get_for_user,
    deployments_visible_to,
)

from . import services
from .filters import BenchmarkRunFilter
from .forms import ImportForm, RunForm
from .models import RunKind, RunState
from .selectors import (
    compare_runs,
    level_rows,
    run_export,
    run_export_csv,
    run_get_for_user,
    run_shown_to,
    runs_visible_to,
)


@login_required
def run_list(request, deployment: str = "", profile: str = ""):
    """History of runs; /benchmarks/deployment/<name>/ and /benchmarks/profile/<name>/ preset a filter."""
    if deployment:
        deployment_get_for_user(request.user, deployment)  # 404 for a deployment the user cannot see
    if profile:
        get_object_or_404(DeploymentProfile, name=profile)
    data = request.GET.copy()
    data.update({key: value for key, value in (("deployment", deployment), ("profile", profile)) if value})
    run_filter, runs, status = filtered(BenchmarkRunFilter, request, runs_visible_to(request.user), data=data)
    filters = {name: run_filter.form.data.get(name, "") for name in run_filter.filters}
    shown = list(runs[:200])
    return render(
        request,
        "benchmarks/run_list.html",
        {
            "runs": shown,
            "filters": filters,
            "fixed_deployment": deployment,
            "fixed_profile": profile,
            # Node acceptances' reference deployments and profiles are not filters a person picks.
            "deployments": deployments_visible_to(request.user).exclude(acceptance_deployment_q()),
            "profiles": DeploymentProfile.objects.exclude(acceptance_profile_q()),
            "mixes": sorted(PRESETS),
            "states": RunState.choices,
            "kinds": RunKind.choices,
            "filter": run_filter,
        },
        status=status,
    )


@login_required
def run_new(request):
    deployments = deployments_visible_to(request.user)
    if request.method == "POST":
        form = RunForm(request.POST, deployments=deployments)
        if form.is_valid():
            data = form.cleaned_data
            try:
                run_request = services.BenchmarkRunRequest(
                    deployment=deployment_get_for_user(request.user, data["deployment"])
                    if data["deployment"]
                    else None,
                    endpoint_url=data["endpoint_url"],
                    model_name=data["model_name"],
                    mix=data["mix"],
                    concurrencies=data["concurrencies"],
                    request_rates=data["request_rates"],
                    requests_per_level=data["requests_per_level"],
                    duration_s=data["duration_s"],
                    seed=data["seed"],
                    level_timeout_s=data["level_timeout_s"],
                    title=data["title"],
                )
                run = services.benchmark_run_create(user=request.user, run_request=run_request)
            except ApplicationError as error:
                form.add_error(error.field if error.field in form.fields else None, error.message)
            else:
                return redirect(run)
    else:
        form = RunForm(initial={"deployment": request.GET.get("deployment", "")}, deployments=deployments)
    return render(request, "benchmarks/run_new.html", {"form": form})


def _level_tables(headers: list[str], rows: list[list[str]]) -> list[tuple[list[str], list[list[str]]]]:
    """The levels table in two parts that each fit the page's width (21 columns do not): throughput
    and TTFT, then per-token latencies and the rest, both keyed by the first column."""
    split = next((i for i, h in enumerate(headers) if h.split()[-2:-1] in (["TPOT"], ["ITL"])), 0)
    if split <= 1:
        return [(headers, rows)]
    return [
        (headers[:split], [row[:split] for row in rows]),
        ([headers[0], *headers[split:]], [[row[0], *row[split:]] for row in rows]),
    ]


@login_required
def run_detail(request, pk: int):
    run = run_get_for_user(request.user, pk)
    levels = list(run.levels.all())
    run_shown_to(request.user, run, levels)  # where engines live: staff only
    results = [level.results for level in levels]
    headers, rows = level_rows(results)
    plots = [
        safe_svg(svg)
        for svg in run_plots(results, sla_ttft_s=run.sla_p95_ttft_s, sla_tpot_s=run.sla_p95_tpot_s)
    ]
    with_samples = [level for level in levels if level.samples.get("ttft_ms")]
    chosen = None
    if with_samples:
        wanted = request.GET.get("level")
        chosen = next((lv for lv in with_samples if str(lv.index) == wanted), with_samples[-1])
    distribution = []
    if chosen is not None:
        name = f"level {chosen.concurrency if chosen.concurrency is not None else chosen.index + 1}"
        distribution = [
            safe_svg(
                histogram(
                    title=f"TTFT distribution, {name}",
                    values=[v / 1000 for v in chosen.samples["ttft_ms"]],
                    x_title="TTFT (s)",
                    limit=(f"SLA {run.sla_p95_ttft_s:g} s", run.sla_p95_ttft_s),
                )
            ),
            safe_svg(
                histogram(
                    title=f"TPOT distribution, {name}",
                    values=[v / 1000 for v in chosen.samples.get("tpot_ms", [])],
                    x_title="TPOT (s)",
                    limit=(f"SLA {run.sla_p95_tpot_s:g} s", run.sla_p95_tpot_s),
                )
            ),
        ]
    checks = []
    for level in levels:
        r = level.results
        checks.append(
            {
                "level": level.concurrency
                if level.concurrency is not None
                else f"rate {level.request_rate:g}/s",
                "little": r.get("little_law") or {},
                "roofline": r.get("roofline"),
                "client_bound": r.get("client_bound"),
                "client_bound_reason": r.get("client_bound_reason"),
                "host_note": r.get("host_note"),
                "client_cpu_share": r.get("client_cpu_share"),
                "loop_lag_p95_ms": r.get("loop_lag_p95_ms"),
                "partial": r.get("partial"),
                "partial_reason": r.get("partial_reason"),
                "errors": r.get("errors") or {},
                "metrics_error": r.get("metrics_error"),
            }
        )
    others = runs_visible_to(request.user).exclude(pk=run.pk)
    if run.deployment_id:
        others = others.filter(deployment=run.deployment)
    return render(
        request,
        "benchmarks/run_detail.html",
        {
            "run": run,
            "levels": levels,
            "headers": headers,
            "rows": rows,
            "level_tables": _level_tables(headers, rows),
            "plots": plots,
            "distribution": distribution,
            "chosen": chosen,
            "with_samples": with_samples,
            "checks": checks,
            "others": others[:20],
            "snapshot_json": json.dumps(run.snapshot, indent=2, sort_keys=True),
        },
    )


@login_required
def run_progress(request, pk: int):
    run = run_shown_to(request.user, run_get_for_user(request.user, pk))
    return JsonResponse(
        {
            "state": run.state,
            "state_reason": run.state_reason,
            "progress": run.progress,
            "levels_saved": run.levels.count(),
            "sla_concurrency": run.sla_concurrency,
        }
    )


@require_POST
@login_required
def run_cancel(request, pk: int):
    run = run_get_for_user(request.user, pk)
    if not (request.user.is_staff or run.created_by_id == request.user.pk):
        raise Http404
    try:
        services.benchmark_run_cancel(run=run)
    except ApplicationError as error:
        messages.error(request, error.message)
    else:
        messages.info(request, "Cancel requested: finished levels are kept.")
    return redirect(run)


@require_POST
@staff_member_required
def run_apply_cap(request, pk: int):
    run = run_get_for_user(request.user, pk)
    try:
        deployment = services.benchmark_run_apply_sla_cap(run=run, user=request.user)
    except ApplicationError as error:
        messages.error(request, error.message)
        return redirect(run)
    messages.info(request, f"{deployment.name}'s gateway cap is now {deployment.concurrency_cap}.")
    return redirect(deployment)


@login_required
def run_export_json(request, pk: int):
    run = run_get_for_user(request.user, pk)
    response = JsonResponse(run_export(run, staff=request.user.is_staff), json_dumps_params={"indent": 2})
    response["Content-Disposition"] = f'attachment; filename="benchmark-run-{run.pk}.json"'
    return response


@login_required
def run_export_csv_view(request, pk: int):
    run = run_get_for_user(request.user, pk)
    response = HttpResponse(run_export_csv(run, staff=request.user.is_staff), content_type="text/csv")
    response["Content-Disposition"] = f'attachment; filename="benchmark-run-{run.pk}.csv"'
    return response


@login_required
def run_compare(request):
    try:
        a_id, b_id = int(request.GET.get("a", "")), int(request.GET.get("b", ""))
    except ValueError:
        # Nothing (or one run) picked: back to the page the button was on, saying what to do.
        messages.error(request, "To compare, pick one run as A and another as B, then press Compare A and B.")
        return redirect(_back_to(request))
    # A run that does not exist or is another team's is a 404, as on every page of a run
    # (the isolation contract: a hidden run and a missing one look the same).
    a, b = run_get_for_user(request.user, a_id), run_get_for_user(request.user, b_id)
    comparison = compare_runs(a, b, staff=request.user.is_staff)
    return render(request, "benchmarks/run_compare.html", {"a": a, "b": b, "comparison": comparison})


def _back_to(request) -> str:
    """The page the request came from when it is one of ours, else the run list."""
    referer = request.headers.get("Referer", "")
    if referer and url_has_allowed_host_and_scheme(
        referer, allowed_hosts={request.get_host()}, require_https=request.is_secure()
    ):
        return referer
    return reverse("benchmarks:run-list")


@staff_member_required
def run_import(request):
    deployments = deployments_visible_to(request.user)
    if request.method == "POST":
        form = ImportForm(request.POST, deployments=deployments)
        if form.is_valid():
            data = form.cleaned_data
            try:
                run = services.benchmark_import_table(
                    user=request.user,
                    title=data["title"],
                    text=data["table"],
                    deployment=deployment_get_for_user(request.user, data["deployment"])
                    if data["deployment"]
                    else None,
                )
            except ApplicationError as error:
                form.add_error("table", error.message)
            else:
                return redirect(run)
    else:
        form = ImportForm(deployments=deployments)
    return render(request, "benchmarks/run_import.html", {"form": form})
