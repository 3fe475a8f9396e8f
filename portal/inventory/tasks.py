"""Node-agent tasks for the inventory. They run on the node's own queue."""

from __future__ import annotations

from celery import shared_task

from portal.core.tasking import skip_missing_row


@shared_task(name="inventory.discover_gpus")
@skip_missing_row("inventory.Node", arg="node_name", field="name")
def discover_gpus(node_name: str) -> int | None:
    """Read this machine's GPUs with nvidia-smi and record them; returns the GPU count.

    Must run on the node itself: send it with `queue=node.queue`.
    """
    from inference.nvidia_smi import discover_local

    from .models import Node
    from .services import node_apply_discovery

    node = Node.objects.get(name=node_name)
    readings, topology = discover_local()
    gpus = node_apply_discovery(node=node, readings=readings, topology=topology)
    if node.vllm_python:
        probe_software(node_name)
    return len(gpus)


@shared_task(name="inventory.probe_software")
@skip_missing_row("inventory.Node", arg="node_name", field="name")
def probe_software(node_name: str) -> dict | None:
    """Report the node's vLLM environment (vLLM, torch, CUDA, kernel arch list).

    Must run on the node itself. A broken environment is recorded on the node, not raised:
    the node page shows why.
    """
    from portal.core.errors import ApplicationError

    from .models import Node
    from .services import node_probe_software

    node = Node.objects.get(name=node_name)
    try:
        facts = node_probe_software(node=node)
    except ApplicationError as error:
        return {"error": error.message}
    return {
        "vllm_version": facts.vllm_version,
        "torch_version": facts.torch_version,
        "torch_cuda_version": facts.torch_cuda_version,
        "arch_list": facts.arch_list,
    }

