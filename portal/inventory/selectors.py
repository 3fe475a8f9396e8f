"""Reads of the inventory."""

from __future__ import annotations

from django.db.models import Count, QuerySet

from .models import Node


def node_list() -> QuerySet[Node]:
    return Node.objects.annotate(gpu_count=Count("gpus")).prefetch_related("gpus")


def gpus_in_use(node: Node, *, exclude_deployment_id: int | None = None) -> dict[int, str]:
    """GPU index → name of the deployment that holds it (desired state running)."""
    from portal.deployments.models import DesiredState

    held: dict[int, str] = {}
    deployments = node.deployments.filter(desired_state=DesiredState.RUNNING)
    if exclude_deployment_id is not None:
        deployments = deployments.exclude(pk=exclude_deployment_id)
    for deployment in deployments:
        for index in deployment.gpu_indices:
            held[index] = deployment.name
    return held
