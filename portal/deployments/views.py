"""Pages for profiles, the deployment list, the planner, and a team's overview (its deployments and
GPUs). A deployment's own page shows its production latency too, so it lives in observability."""

from __future__ import annotations

from typing import Any

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.utils.http import urlencode
from django.views.decorators.http import require_POST

from inference.rules import finding_title
from portal.core.errors import ApplicationError
from portal.core.filters import filtered
from portal.inventory.models import Node
from portal.teams.selectors import api_keys_of, team_get_for_user

from . import services
from .filters import DeploymentFilter, ProfileFilter
from .forms import DeploymentCreateForm, PlannerForm
from .models import DeploymentProfile
from .selectors import (
    acceptance_deployment_q,
    acceptance_profile_q,
    deployment_get_for_user,
    deployments_visible_to,
    gpus_held_by_team,
    gpus_held_per_node,
    listed,
)


def plan_or_error(compute):
    """(plan dict, None) or (None, error message): a page shows either."""
    try:
        plan = compute()
    except ApplicationError as error:
        return None, f"{error.field}: {error.message}" if error.field else error.message
    return (plan.to_dict() if plan is not None else None), None


def _acceptance_shown(request) -> bool:
    return request.GET.get("acceptance") == "show"


@login_required
def profile_list(request):
    """Profiles; node acceptance's own only with ?acceptance=show."""
    acceptance = _acceptance_shown(request)
    profile_filter, profiles, status = filtered(
        ProfileFilter, request, DeploymentProfile.objects.select_related("model_version")
    )
    profiles, hidden = listed(profiles, acceptance_profile_q(), acceptance=acceptance)
    rows = []
    for profile in profiles:
        plan = plan_or_error(lambda p=profile: services.profile_plan(p))[0]
        # Short names with the message on hover: the codes alone mean nothing to a reader.
        findings = [
            {"level": f["level"], "title": finding_title(f["code"]), "message": f["message"]}
            for f in (plan["findings"] if plan else [])
            if f["level"] in ("error", "warning")
        ]
        rows.append((profile, plan, findings))
    return render(
        request,
        "deployments/profile_list.html",
        {"rows": rows, "acceptance": acceptance, "acceptance_count": hidden, "filter": profile_filter},
        status=status,
    )


@login_required
def profile_detail(request, name: str):
    profile = get_object_or_404(DeploymentProfile.objects.select_related("model_version"), name=name)
    plan, error = plan_or_error(lambda: services.profile_plan(profile))
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
    """Deployments; node acceptance's stopped burn-in deployments only with ?acceptance=show."""
    acceptance = _acceptance_shown(request)
    deployment_filter, deployments, status = filtered(
        DeploymentFilter, request, deployments_visible_to(request.user)
    )
    deployments, hidden = listed(deployments, acceptance_deployment_q(), acceptance=acceptance)
    context = {
        "deployments": deployments,
        "acceptance": acceptance,
        "acceptance_count": hidden,
        "filter": deployment_filter,
    }
    return render(request, "deployments/deployment_list.html", context, status=status)


@login_required
def deployment_new(request):
    """Create a deployment (staff): pick node, model version, profile, GPUs and team; the same checks
    as the API (`deployment_check` in `deployment_create`), each refusal beside its field."""
    if not request.user.is_staff:
        raise PermissionDenied
    initial = {key: request.GET[key] for key in ("node", "profile", "team") if key in request.GET}
    form = DeploymentCreateForm(request.POST or None, initial=_initial_rows(initial))
    if request.method == "POST" and form.is_valid():
        try:
            deployment = services.deployment_create(**form.create_values())
        except ApplicationError as error:
            field = {"gpu_indices": "gpu_indices"}.get(error.field, error.field)
            form.add_error(field if field in form.fields else None, error.message)
        else:
            started = deployment.desired_state == "running"
            messages.success(
                request,
                f"deployment {deployment.name} created"
                + (f": the agent on {deployment.placed_node.name} starts it" if started else " (stopped)"),
            )
            return redirect(deployment)
    nodes = list(Node.objects.prefetch_related("gpus").order_by("name"))
    held = gpus_held_per_node()
    free = []
    for node in nodes:
        gpus = list(node.gpus.all())
        free.append((node, [g.index for g in gpus if g.index not in held.get(node.pk, ())], len(gpus)))
    return render(
        request,
        "deployments/deployment_new.html",
        {"form": form, "free": free},
        status=400 if form.errors else 200,
    )


def _initial_rows(names: dict[str, str]) -> dict:
    """?node=…&profile=…&team=… from a link (the node page, a profile) as the form's initial rows."""
    from portal.teams.models import Team

    lookups: dict[str, tuple[Any, str]] = {
        "node": (Node, "name"),
        "profile": (DeploymentProfile, "name"),
        "team": (Team, "slug"),
    }
    initial = {}
    for key, value in names.items():
        model, field = lookups[key]
        row = model.objects.filter(**{field: value[:100]}).first()
        if row is not None:
            initial[key] = row.pk
            if key == "profile":
                initial["model_version"] = row.model_version_id
    return initial


@login_required
def team_detail(request, slug: str):
    """A team's overview: GPUs held against its quota, members, keys, and its deployments."""
    team = team_get_for_user(request.user, slug)
    return render(
        request,
        "deployments/team_detail.html",
        {
            "team": team,
            "gpus_held": gpus_held_by_team(team),
            "deployments": deployments_visible_to(request.user).filter(team=team),
            "active_keys": api_keys_of(team).filter(revoked_at__isnull=True).count(),
        },
    )


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
        messages.success(request, f"{action} requested: the agent on {deployment.placed_node.name} is on it")
    return redirect(deployment)


@login_required
def planner(request):
    """Try a model × profile × GPUs without saving anything (GET, so results can be linked)."""
    plan, error, profile_link = None, None, None
    if "model" in request.GET:
        form = PlannerForm(request.GET)
        if form.is_valid():
            plan, error = plan_or_error(lambda: _plan_from_form(form))
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
