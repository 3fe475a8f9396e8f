"""Inventory pages: nodes and their GPUs."""

from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.shortcuts import get_object_or_404, render

from .selectors import gpus_in_use, node_list


@login_required
def node_list_view(request):
    return render(request, "inventory/node_list.html", {"nodes": node_list()})


@login_required
def node_detail(request, name: str):
    node = get_object_or_404(node_list(), name=name)
    held = gpus_in_use(node)
    gpus = [(gpu, held.get(gpu.index, "")) for gpu in node.gpus.all()]
    return render(request, "inventory/node_detail.html", {"node": node, "gpus": gpus})
