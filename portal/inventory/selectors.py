"""Reads of the inventory."""

from __future__ import annotations

import datetime as dt
from collections import defaultdict
from typing import Any

from django.db.models import Case, Count, QuerySet, When

from inference.errors import InputError
from inference.nvidia_smi import Topology, parse_topology

from .models import Gpu, GpuHealth, GpuSample, Node


def node_list() -> QuerySet[Node]:
    return Node.objects.annotate(gpu_count=Count("gpus")).prefetch_related("gpus")


def node_latest_calibration(node: Node) -> dict[str, Any] | None:
    """The simulator calibration of the node's latest finished acceptance that fitted one, or None.

    Here with the record, not in portal/benchmarks/acceptance/: the simulator (`simulate --node`,
    portal/deployments/predict.py) reads it, and deployments sit below benchmarks.

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
    assert acceptance.calibration is not None  # excluded above
    return dict(acceptance.calibration)


def gpus_not_healthy() -> QuerySet[Gpu]:
    """GPUs whose last sample found something (warning, degraded, lost), worst first: the dashboard's list."""
    order = Case(
        When(health_state=GpuHealth.LOST, then=0),
        When(health_state=GpuHealth.DEGRADED, then=1),
        default=2,
    )
    bad = [GpuHealth.WARNING, GpuHealth.DEGRADED, GpuHealth.LOST]
    gpus = Gpu.objects.select_related("node").filter(health_state__in=bad)
    return gpus.order_by(order, "node__name", "index")


def gpu_samples_since(node: Node, since: dt.datetime) -> dict[int, list[GpuSample]]:
    """GPU index → its per-minute samples since `since`, oldest first (the node page's charts)."""
    series: dict[int, list[GpuSample]] = defaultdict(list)
    for sample in (
        GpuSample.objects.filter(gpu__node=node, minute__gte=since).select_related("gpu").order_by("minute")
    ):
        series[sample.gpu.index].append(sample)
    return dict(series)


def node_topology(node: Node, gpus: list[Gpu] | None = None) -> Topology:
    """The node's GPU topology: its last `nvidia-smi topo -m` where one was stored and still
    names every GPU, else one built from the GPUs' NVLink peers (the other pairs then unknown,
    `N/A`, rather than assumed PCIe)."""
    gpus = list(node.gpus.all()) if gpus is None else gpus
    indices = sorted(gpu.index for gpu in gpus)
    if node.topology_text.strip():
        try:
            stored = parse_topology(node.topology_text)
        except InputError:
            stored = None
        if stored is not None and set(indices) <= set(stored.indices):
            return stored
    # NVLink is symmetric; a hand-entered peer list may name only one direction.
    linked = {frozenset((gpu.index, peer)) for gpu in gpus for peer in gpu.nvlink_peers}
    links = {
        (a, b): "NV1" if frozenset((a, b)) in linked else "N/A" for a in indices for b in indices if a != b
    }
    return Topology(links=links, gpus=tuple(indices))
