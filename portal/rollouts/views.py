"""The rollout page: its steps, the live shares, both versions' measurements against the SLA since
the step began, the timeline, and (for staff) the buttons."""

from __future__ import annotations

from collections.abc import Callable

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.http import require_POST

from inference.rollout import Evaluation
from portal.core.errors import ApplicationError
from portal.core.filters import filtered
from portal.registry.services import served_model_create, served_model_set_shares

from . import services
from .filters import RolloutFilter
from .forms import RolloutStartForm, ServedModelCreateForm, SharesForm
from .models import RolloutState
from .selectors import (
    active_rollout_of,
    rollout_deployments_shown,
    rollout_warnings,
    rollouts_visible_to,
    served_model_lines,
    served_models_visible_to,
)

ACTIONS: dict[str, Callable[..., object]] = {
    "pause": services.rollout_pause,
    "resume": services.rollout_resume,
    "promote": services.rollout_promote,
    "rollback": services.rollout_rollback,
}


@login_required
def rollout_list(request):
    rollout_filter, rollouts, status = filtered(RolloutFilter, request, rollouts_visible_to(request.user))
    context = {"rollouts": rollouts[:200], "filter": rollout_filter}
    return render(request, "rollouts/rollout_list.html", context, status=status)


@login_required
def rollout_new(request):
    if not request.user.is_staff:
        raise PermissionDenied
    form = RolloutStartForm(request.POST or None)
    gpu_choices = []  # the ways to free held GPUs, offered when none are free
    if request.method == "POST" and form.is_valid():
        try:
            rollout = services.rollout_start(**form.cleaned_data, actor=request.user)
        except ApplicationError as error:
            form.add_error(error.field if error.field in form.fields else None, error.message)
            gpu_choices = error.extra.get("choices", [])
        else:
            messages.success(request, "Rollout started: the new version gets traffic once it serves")
            for warning in rollout_warnings(rollout):
                messages.warning(request, warning)
            return redirect(reverse("rollouts:rollout-detail", args=[rollout.pk]))
    return render(request, "rollouts/rollout_new.html", {"form": form, "gpu_choices": gpu_choices})


@login_required
def rollout_detail(request, pk: int):
    rollout = get_object_or_404(rollouts_visible_to(request.user), pk=pk)
    shares = {
        name: share / 100
        for name, share in rollout.served_model.versions.values_list("model_version__name", "share_bp")
    }
    windows = None
    if rollout.step_started_at is not None and rollout.state in (RolloutState.STEPPING, RolloutState.PAUSED):
        new, old = services.step_windows(rollout, now=timezone.now())
        windows = {"new": new, "old": old}
    steps = [
        {"index": i, "share_percent": s.share_percent, "length": s.describe(),
         "current": i == rollout.current_step and rollout.is_active,
         "done": rollout.current_step is not None and i < rollout.current_step}
        for i, s in enumerate(rollout.step_list())
    ]  # fmt: skip
    return render(
        request,
        "rollouts/rollout_detail.html",
        {
            "rollout": rollout,
            "shown": rollout_deployments_shown(request.user, rollout),
            "steps": steps,
            "shares": shares,
            "windows": windows,
            "sla_ttft_ms": rollout.to_deployment.sla_p95_ttft_s * 1000,
            "sla_tpot_ms": rollout.to_deployment.sla_p95_tpot_s * 1000,
            "events": rollout.events.all(),
            "last_evaluation": _last_evaluation(rollout),
            "refresh_s": 15 if rollout.is_active else 300,
        },
    )


def _last_evaluation(rollout) -> str:
    """The last judgement as a sentence (an evaluation stored before rules were recorded: none)."""
    found = Evaluation.from_dict(rollout.measurements or {})
    return found.describe() if found is not None else ""


@login_required
@require_POST
def rollout_action(request, pk: int, action: str):
    rollout = get_object_or_404(rollouts_visible_to(request.user), pk=pk)
    service = ACTIONS.get(action)
    if not request.user.is_staff or service is None:
        raise PermissionDenied
    try:
        service(rollout=rollout, actor=request.user)
    except ApplicationError as error:
        messages.error(request, error.message)
    else:
        messages.success(request, f"{action}: done")
    return redirect(reverse("rollouts:rollout-detail", args=[rollout.pk]))


@login_required
def served_model_list(request):
    served = list(served_models_visible_to(request.user)[:500])
    active = {
        r.served_model_id: r
        for r in rollouts_visible_to(request.user).filter(state__in=["warming", "stepping", "paused"])
    }
    rows = [(s, active.get(s.pk)) for s in served]
    form = ServedModelCreateForm() if request.user.is_staff else None
    return render(request, "rollouts/served_model_list.html", {"rows": rows, "form": form})


@login_required
def served_model_new(request):
    """Staff: a served name over versions with their shares (the list page's form)."""
    if not request.user.is_staff:
        raise PermissionDenied
    form = ServedModelCreateForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        try:
            served = served_model_create(**form.cleaned_data, actor=request.user)
        except ApplicationError as error:
            form.add_error(error.field if error.field in form.fields else "shares", error.message)
        else:
            messages.success(request, f"Served name {served.name} created")
            return redirect(reverse("rollouts:served-model-detail", args=[served.name]))
    return render(request, "rollouts/served_model_new.html", {"form": form})


@login_required
@require_POST
def served_model_shares(request, name: str):
    """Staff: set every version's share at once (the detail page's form)."""
    if not request.user.is_staff:
        raise PermissionDenied
    served = get_object_or_404(served_models_visible_to(request.user), name=name)
    form = SharesForm(request.POST)
    if not form.is_valid():
        messages.error(
            request, "Shares not set: " + "; ".join(str(e) for errs in form.errors.values() for e in errs)
        )
    else:
        try:
            served_model_set_shares(
                served_model=served,
                shares=form.cleaned_data["shares"],
                actor=request.user,
                reason="set by hand",
            )
        except ApplicationError as error:
            messages.error(request, f"Shares not set: {error.message}")
        else:
            messages.success(request, "Shares set")
    return redirect(reverse("rollouts:served-model-detail", args=[served.name]))


@login_required
def served_model_detail(request, name: str):
    served = get_object_or_404(served_models_visible_to(request.user), name=name)
    rollout = active_rollout_of(served, request.user)
    lines = served_model_lines(served, request.user)
    return render(
        request,
        "rollouts/served_model_detail.html",
        {
            "served": served,
            "lines": lines,
            "rollout": rollout,
            "rollouts": rollouts_visible_to(request.user).filter(served_model=served)[:50],
            "shares_form": SharesForm(
                initial={"shares": ", ".join(f"{line.name}={line.share_percent:g}" for line in lines)}
            )
            if request.user.is_staff
            else None,
            "refresh_s": 15 if rollout is not None else 300,
        },
    )
