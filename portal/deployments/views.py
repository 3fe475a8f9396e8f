"""Pages for profiles, deployments and the planner."""

from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.shortcuts import get_object_or_404, render

from portal.core.errors import ApplicationError

from . import services
from .forms import PlannerForm
from .models import DeploymentProfile
from .selectors import deployment_get_for_user, deployments_visible_to


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
    rows = [(profile, _plan_or_error(lambda p=profile: services.profile_plan(p))[0]) for profile in profiles]
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
    plan, error = _plan_or_error(lambda: services.deployment_plan(deployment))
    return render(
        request,
        "deployments/deployment_detail.html",
        {"deployment": deployment, "plan": plan, "plan_error": error},
    )


@login_required
def planner(request):
    """Try a model × profile × GPUs without saving anything (GET, so results can be linked)."""
    plan, error = None, None
    if "model" in request.GET:
        form = PlannerForm(request.GET)
        if form.is_valid():
            plan, error = _plan_or_error(lambda: _plan_from_form(form.cleaned_data))
    else:
        profile = DeploymentProfile.objects.filter(name=request.GET.get("profile", "")).first()
        form = PlannerForm(initial=PlannerForm.initial_from_profile(profile) if profile else None)
    return render(request, "deployments/planner.html", {"form": form, "plan": plan, "plan_error": error})


def _plan_from_form(data: dict):
    return services.plan_on_catalog_gpus(
        model=data["model"],
        gpu=data["gpu"],
        gpus=data["gpus"],
        nvlink={"nvlink": True, "pcie": False}.get(data["interconnect"]),
        dtype=data["dtype"],
        tensor_parallel_size=data["tensor_parallel_size"],
        quantization=data["quantization"] or None,
        max_model_len=data["max_model_len"],
        gpu_memory_utilization=data["gpu_memory_utilization"],
        max_num_seqs=data["max_num_seqs"],
        block_size=data["block_size"],
        enforce_eager=data["enforce_eager"],
        enable_prefix_caching=data["enable_prefix_caching"],
        enable_chunked_prefill=data["enable_chunked_prefill"],
    )
