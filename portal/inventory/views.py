"""Inventory pages: nodes and their GPUs."""

from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.shortcuts import get_object_or_404, render

from inference.env_probe import build_advice, missing_kernels

from .selectors import gpus_in_use, node_list


@login_required
def node_list_view(request):
    return render(request, "inventory/node_list.html", {"nodes": node_list()})


@login_required
def node_detail(request, name: str):
    node = get_object_or_404(node_list(), name=name)
    held = gpus_in_use(node)
    gpus = [(gpu, held.get(gpu.index, "")) for gpu in node.gpus.all()]
    return render(
        request,
        "inventory/node_detail.html",
        {"node": node, "gpus": gpus, "kernel_warnings": _kernel_warnings(node, [g for g, _ in gpus])},
    )


def _kernel_warnings(node, gpus) -> list[str]:
    """FIELD_NOTES: a torch build without the GPUs' sm_XY fails at the first kernel."""
    if not gpus or not node.torch_cuda_version:
        return []
    missing = missing_kernels(node.torch_arch_list, [g.compute_capability for g in gpus])
    if not missing:
        return []
    return [f"torch {node.torch_version} has no {', '.join(missing)} kernels: {build_advice(missing)}"]
