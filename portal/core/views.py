"""The front page."""

from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.shortcuts import render

from portal.deployments.models import DeploymentProfile
from portal.deployments.selectors import deployments_visible_to
from portal.inventory.selectors import node_list
from portal.registry.models import ModelVersion


@login_required
def home(request):
    nodes = node_list()
    return render(
        request,
        "core/home.html",
        {
            "nodes": nodes,
            "gpu_total": sum(node.gpu_count for node in nodes),
            "model_count": ModelVersion.objects.count(),
            "profile_count": DeploymentProfile.objects.count(),
            "deployments": deployments_visible_to(request.user),
            "teams": request.user.teams.all(),
        },
    )
