"""The node acceptance's view: *Accept this node* on the node's page (`nodes:accept`). The page
itself, with the latest acceptance and its plots, is the node's page (portal/benchmarks/node_views.py)."""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.shortcuts import get_object_or_404, redirect
from django.views.decorators.http import require_POST

from portal.core.errors import ApplicationError
from portal.inventory.selectors import node_list

from ..node_views import node_detail
from .forms import AcceptanceForm
from .request import node_acceptance_request


@login_required
@require_POST
def node_accept(request, name: str):
    """Staff: ask the node's agent to accept the node; a refused form is shown on the node's page."""
    if not request.user.is_staff:
        raise PermissionDenied
    node = get_object_or_404(node_list(), name=name)
    form = AcceptanceForm(request.POST, node=node)
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
                profile=values["profile"].name if values.get("profile") else None,
                max_model_len=values.get("max_model_len"),
            )
        except ApplicationError as error:
            form.add_error(error.field if error.field in form.fields else None, error.message)
        else:
            messages.success(
                request, f"acceptance {acceptance.pk} requested: the agent on {node.name} is on it"
            )
            return redirect(node)
    return node_detail(request, name, accept_form=form, status=400)
