"""Reads of the inventory."""

from __future__ import annotations

from django.db.models import Count, QuerySet

from .models import Node


def node_list() -> QuerySet[Node]:
    return Node.objects.annotate(gpu_count=Count("gpus")).prefetch_related("gpus")


def node_latest_acceptance(node: Node):
    """The node's most recent acceptance (running or finished), or None."""
    return node.acceptances.order_by("-started_at", "-id").first()


def node_latest_calibration(node: Node) -> dict | None:
    """The simulator calibration of the node's latest finished acceptance that fitted one, or None.

    The constants belong to the node and its vLLM version (docs/decisions.md): once the node's
    probed vLLM differs from the one the acceptance ran, the calibration no longer applies.
    """
    from .models import AcceptanceState

    acceptance = (
        node.acceptances.filter(state__in=[AcceptanceState.PASSED, AcceptanceState.SLOW])
        .exclude(calibration=None)
        .order_by("-finished_at", "-id")
        .first()
    )
    if acceptance is None:
        return None
    if node.vllm_version and acceptance.versions.get("vllm", "") != node.vllm_version:
        return None
    return dict(acceptance.calibration)
