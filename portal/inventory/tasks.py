"""Node-agent tasks for the inventory. They run on the node's own queue."""

from __future__ import annotations

from celery import shared_task


@shared_task(name="inventory.discover_gpus")
def discover_gpus(node_name: str) -> int:
    """Read this machine's GPUs with nvidia-smi and record them; returns the GPU count.

    Must run on the node itself: send it with `queue=node.queue`.
    """
    from inference.nvidia_smi import discover_local

    from .models import Node
    from .services import node_apply_discovery

    node = Node.objects.get(name=node_name)
    readings, topology = discover_local()
    return len(node_apply_discovery(node=node, readings=readings, topology=topology))
