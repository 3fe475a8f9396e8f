"""Model registry pages, and the bf16 → fp16 conversion pages."""

from __future__ import annotations

from django import forms
from django.contrib import messages
from django.contrib.admin.views.decorators import staff_member_required
from django.contrib.auth.decorators import login_required
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_POST

from portal.core.errors import ApplicationError
from portal.core.filters import filtered
from portal.inventory.models import Node

from .filters import ModelVersionFilter
from .models import ConversionJob, ModelVersion, WeightDtype
from .selectors import model_versions_listed, model_versions_shown_to
from .services import conversion_job_start, model_version_mark_simulated_release, model_version_request_hashes


class ConvertForm(forms.Form):
    node = forms.ModelChoiceField(
        queryset=Node.objects.all(), to_field_name="name", help_text="The node holding the files."
    )
    name = forms.CharField(required=False, help_text="New version's name (default: <name>-fp16).")
    clamp = forms.BooleanField(required=False, help_text="Clamp values beyond ±65504 instead of stopping.")


class HashForm(forms.Form):
    node = forms.ModelChoiceField(
        queryset=Node.objects.all(), to_field_name="name", help_text="The node holding the files."
    )


def _only_node_initial() -> dict:
    only = list(Node.objects.all()[:2])
    return {"node": only[0] if len(only) == 1 else None}


@login_required
def model_list(request):
    """Model versions; node acceptance's reference models only with ?acceptance=show."""
    acceptance = request.GET.get("acceptance") == "show"
    model_filter, versions, status = filtered(
        ModelVersionFilter, request, model_versions_listed(acceptance=acceptance)
    )
    context = {
        "models": model_versions_shown_to(request.user, versions),
        "filter": model_filter,
        "acceptance": acceptance,
        "acceptance_count": 0 if acceptance else model_versions_listed(acceptance=True).count(),
    }
    return render(request, "registry/model_list.html", context, status=status)


@login_required
def model_detail(request, name: str):
    (model,) = model_versions_shown_to(request.user, [get_object_or_404(ModelVersion, name=name)])
    context = {"model": model, "conversions": model.conversions.select_related("result", "node")[:10]}
    if request.user.is_staff and model.path and not model.weights_sha256:
        context["hash_form"] = HashForm(initial=_only_node_initial())
    # The page follows a Hash files job while it runs (the agent writes its progress as it goes).
    context["hashing"] = model.hash_status.startswith(("queued", "hashing"))
    context["can_mark_simulated"] = (
        request.user.is_staff
        and not model.external
        and not model.weights_sha256
        and model.simulated_release_at is None
    )
    if request.user.is_staff and model.weight_dtype == WeightDtype.BFLOAT16 and not model.quantization:
        context["convert_form"] = ConvertForm(initial=_only_node_initial())
    return render(request, "registry/model_detail.html", context)


@require_POST
@staff_member_required
def model_convert(request, name: str):
    model = get_object_or_404(ModelVersion, name=name)
    form = ConvertForm(request.POST)
    if form.is_valid():
        try:
            job = conversion_job_start(
                model_version=model,
                node=form.cleaned_data["node"],
                new_name=form.cleaned_data["name"],
                clamp=form.cleaned_data["clamp"],
                requested_by=request.user,
            )
        except ApplicationError as error:
            messages.error(request, f"Not started: {error.message}")
        else:
            return redirect(job)
    else:
        messages.error(request, "Not started: " + "; ".join(f"{f}: {e[0]}" for f, e in form.errors.items()))
    return redirect(model)


@require_POST
@staff_member_required
def model_hash(request, name: str):
    model = get_object_or_404(ModelVersion, name=name)
    form = HashForm(request.POST)
    if not form.is_valid():
        messages.error(request, "Not hashed: " + "; ".join(f"{f}: {e[0]}" for f, e in form.errors.items()))
        return redirect(model)
    node = form.cleaned_data["node"]
    try:
        model_version_request_hashes(model_version=model, node=node)
    except ApplicationError as error:
        messages.error(request, f"Not hashed: {error.message}")
    else:
        messages.info(request, f"The agent on {node.name} is hashing {model.path}: reload in a moment.")
    return redirect(model)


@require_POST
@staff_member_required
def model_mark_simulated(request, name: str):
    model = get_object_or_404(ModelVersion, name=name)
    try:
        model_version_mark_simulated_release(model_version=model, actor=request.user)
    except ApplicationError as error:
        messages.error(request, f"Not marked: {error.message}")
    else:
        messages.success(request, f"{model.name} is release-checked for simulated nodes only.")
    return redirect(model)


@login_required
def conversion_detail(request, name: str, pk: int):
    job = get_object_or_404(
        ConversionJob.objects.select_related("source", "result", "node"), pk=pk, source__name=name
    )
    return render(request, "registry/conversion_detail.html", {"job": job})
