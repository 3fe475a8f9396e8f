"""Inventory pages: nodes and their GPUs."""

from __future__ import annotations

from django import forms
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_POST

from inference.env_probe import build_advice, missing_kernels
from inference.hardware import GPU_CATALOG
from inference.tiny_model import shape_names
from portal.audit.services import audit_event_record
from portal.benchmarks.plots import acceptance_plots, safe_svg
from portal.core.errors import ApplicationError

from .acceptance import (
    DEFAULT_CONCURRENCY,
    DEFAULT_MIX,
    DEFAULT_SHAPE,
    MAX_REQUESTS_PER_LEVEL,
    node_acceptance_request,
)
from .forms import NodeCreateForm
from .selectors import gpus_in_use, node_latest_acceptance, node_list
from .services import node_create_from_nvidia_smi


@login_required
def node_list_view(request):
    return render(request, "inventory/node_list.html", {"nodes": node_list()})


@login_required
def node_new(request):
    """Add a node (staff), with its GPUs from pasted nvidia-smi output: all of it, or nothing."""
    if not request.user.is_staff:
        raise PermissionDenied
    form = NodeCreateForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        data = form.cleaned_data
        try:
            node = node_create_from_nvidia_smi(
                name=data["name"],
                hostname=data["hostname"],
                description=data["description"],
                vllm_python=data["vllm_python"],
                query_csv=data["nvidia_smi_query"],
                topology_text=data["nvidia_smi_topology"],
            )
        except ApplicationError as error:
            # The pasted text stays in the form, with the failing part named beside it.
            form.add_error(error.field if error.field in form.fields else None, error.message)
        else:
            audit_event_record(action="node.create", target=node, changes={"gpus": node.gpus.count()})
            messages.success(request, f"node {node.name} added with {node.gpus.count()} GPUs")
            return redirect("inventory:node-detail", name=node.name)
    return render(request, "inventory/node_new.html", {"form": form}, status=400 if form.errors else 200)


@login_required
def node_detail(request, name: str, *, accept_form: forms.Form | None = None, status: int = 200):
    node = get_object_or_404(node_list(), name=name)
    held = gpus_in_use(node)
    gpus = [(gpu, held.get(gpu.index, "")) for gpu in node.gpus.all()]
    context = {
        "node": node,
        "gpus": gpus,
        "kernel_warnings": _kernel_warnings(node, [g for g, _ in gpus]),
        "accept_form": accept_form or AcceptanceForm(),
        **_acceptance_context(node),
    }
    return render(request, "inventory/node_detail.html", context, status=status)


def _kernel_warnings(node, gpus) -> list[str]:
    """A torch build without the GPUs' sm_XY fails at the first kernel
    (docs/v100-field-guide.md#software-stack)."""
    if not gpus or not node.torch_cuda_version:
        return []
    missing = missing_kernels(node.torch_arch_list, [g.compute_capability for g in gpus])
    if not missing:
        return []
    return [f"torch {node.torch_version} has no {', '.join(missing)} kernels: {build_advice(missing)}"]


class AcceptanceForm(forms.Form):
    """The node page's "accept this node" form; bounds here, the rest checked by the service."""

    shape = forms.ChoiceField(choices=[(name, name) for name in shape_names()], initial=DEFAULT_SHAPE)
    layers = forms.IntegerField(min_value=1, max_value=512, required=False, help_text="blank: the shape's")
    concurrency = forms.CharField(
        max_length=100, initial=",".join(map(str, DEFAULT_CONCURRENCY)), help_text="2 to 4 levels"
    )
    mix = forms.CharField(max_length=200, initial=DEFAULT_MIX)
    requests_per_level = forms.IntegerField(
        min_value=1, max_value=MAX_REQUESTS_PER_LEVEL, required=False, help_text="blank: 4 per user"
    )
    enforce_eager = forms.BooleanField(required=False, label="eager (no CUDA graphs)")
    predict_gpu = forms.ChoiceField(
        choices=[("", "the node's GPU"), *((key, key) for key in sorted(GPU_CATALOG))], required=False
    )


def _acceptance_context(node) -> dict:
    acceptance = node_latest_acceptance(node)
    plots = [safe_svg(svg) for svg in acceptance_plots(acceptance.levels)] if acceptance else []
    return {"acceptance": acceptance, "acceptance_plots": plots}


@login_required
@require_POST
def node_accept(request, name: str):
    """Staff: ask the node's agent to accept the node (portal/inventory/acceptance.py)."""
    if not request.user.is_staff:
        raise PermissionDenied
    node = get_object_or_404(node_list(), name=name)
    form = AcceptanceForm(request.POST)
    if form.is_valid():
        values = form.cleaned_data
        try:
            acceptance = node_acceptance_request(
                node=node,
                user=request.user,
                shape=values["shape"],
                layers=values["layers"],
                concurrency=values["concurrency"],
                mix=values["mix"],
                requests_per_level=values["requests_per_level"],
                enforce_eager=values["enforce_eager"],
                predict_gpu=values["predict_gpu"],
            )
        except ApplicationError as error:
            form.add_error(error.field if error.field in form.fields else None, error.message)
        else:
            messages.success(
                request, f"acceptance {acceptance.pk} requested: the agent on {node.name} is on it"
            )
            return redirect(node)
    return node_detail(request, name, accept_form=form, status=400)
