"""Inventory pages: the node list and adding a node. A node's own page shows who holds its GPUs
and its acceptance, so it lives above both (portal/benchmarks/node_views.py)."""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.shortcuts import redirect, render

from portal.audit.services import audit_event_record
from portal.core.errors import ApplicationError
from portal.core.filters import filtered

from .filters import NodeFilter
from .forms import NodeCreateForm
from .selectors import node_list
from .services import node_create_from_nvidia_smi


@login_required
def node_list_view(request):
    node_filter, nodes, status = filtered(NodeFilter, request, node_list())
    return render(request, "inventory/node_list.html", {"nodes": nodes, "filter": node_filter}, status=status)


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
            return redirect(node)
    return render(request, "inventory/node_new.html", {"form": form}, status=400 if form.errors else 200)
