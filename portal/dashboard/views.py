"""The front page: the ops dashboard for staff, the team front page for everyone else."""

from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.db.models import Q
from django.shortcuts import render

from portal.batches.load import batch_load_by_model
from portal.core.charts import bar_chart_svg
from portal.core.heartbeat import live_namespaces
from portal.deployments.models import DeploymentProfile, DeploymentState, DesiredState
from portal.deployments.selectors import acceptance_deployment_q, acceptance_profile_q, deployments_visible_to
from portal.observability.selectors import sla_breaches, traffic_last_hour
from portal.registry.models import ModelVersion
from portal.registry.selectors import acceptance_model_q

from .selectors import (
    deployment_health,
    gpus_not_healthy_with_holders,
    node_occupancy,
    recent_benchmark_runs,
    team_fronts,
)


@login_required
def home(request):
    if request.user.is_staff:
        return _ops_dashboard(request)
    return render(
        request,
        "dashboard/team_home.html",
        {"fronts": team_fronts(request.user), "base_url": request.build_absolute_uri("/v1")},
    )


def _ops_dashboard(request):
    occupancy = node_occupancy()
    # A stopped node-acceptance deployment is a finished burn-in, not part of the fleet (a running
    # one still shows while its acceptance works).
    finished_burn_ins = acceptance_deployment_q() & Q(desired_state=DesiredState.STOPPED)
    deployments = deployment_health(deployments_visible_to(request.user).exclude(finished_burn_ins))
    traffic = traffic_last_hour()
    processes = live_namespaces()
    return render(
        request,
        "dashboard/home.html",
        {
            "occupancy": occupancy,
            "gpu_total": sum(o.gpus for o in occupancy),
            "gpu_held": sum(o.held for o in occupancy),
            "model_count": ModelVersion.objects.exclude(acceptance_model_q()).count(),
            "profile_count": DeploymentProfile.objects.exclude(acceptance_profile_q()).count(),
            "deployments": deployments,
            "serving_count": sum(1 for d in deployments if d.deployment.state == DeploymentState.SERVING),
            "failing_count": sum(1 for d in deployments if d.health == "failing"),
            "traffic": traffic,
            "traffic_totals": _totals(traffic),
            "charts": _traffic_charts(traffic) if traffic is not None else [],
            "runs": recent_benchmark_runs(),
            "breaches": sla_breaches(open_only=True, limit=50),
            "teams": request.user.teams.all(),
            "processes": processes,
            "namespace_split": sorted({p.namespace for p in processes or []}) if processes else [],
            "sick_gpus": gpus_not_healthy_with_holders(),
            "batch_load": _batch_load(deployments),
        },
    )


def _batch_load(deployments) -> list[dict]:
    """Batch lines in flight and queued per model, with the deployments that serve it (lines carry
    no deployment: the gateway places each on one of them)."""
    serving: dict[str, list] = {}
    for h in deployments:
        serving.setdefault(h.deployment.model_version.name, []).append(h.deployment)
    return [
        {
            "model": load.model,
            "in_flight": load.in_flight,
            "queued": load.queued,
            "deployments": serving.get(load.model, []),
        }
        for load in batch_load_by_model()
    ]


def _totals(traffic) -> dict | None:
    if traffic is None:
        return None
    return {
        "requests": sum(m.requests for m in traffic),
        "tokens": sum(m.tokens for m in traffic),
        "errors": sum(m.errors for m in traffic),
        "rejected": sum(m.rejected for m in traffic),
    }


def _traffic_charts(traffic) -> list:
    def chart(title: str, values: list[float]):
        points = [(m.start.strftime("%H:%M"), round(v, 2)) for m, v in zip(traffic, values, strict=True)]
        return bar_chart_svg(points, title=title, width=560, height=170, label_every=10)

    return [
        chart("Requests per second", [m.requests_per_s for m in traffic]),
        chart("Tokens per second (prompt + completion)", [m.tokens_per_s for m in traffic]),
        chart("Upstream errors per minute (failures, timeouts)", [m.errors for m in traffic]),
        chart("Rejections per minute (keys, quotas, queue, bad input)", [m.rejected for m in traffic]),
        chart("Queue depth (largest sample per minute)", [m.queue_depth or 0 for m in traffic]),
    ]
