"""Node-agent tasks for the inventory. They run on the node's own queue."""

from __future__ import annotations

from celery import shared_task
from celery.signals import worker_ready
from django.conf import settings

from portal.core.tasking import skip_missing_row


@shared_task(name="inventory.discover_gpus")
@skip_missing_row("inventory.Node", arg="node_name", field="name")
def discover_gpus(node_name: str) -> int | None:
    """Read this machine's GPUs with nvidia-smi and record them; returns the GPU count.

    Must run on the node itself: send it with `queue=node.queue`.
    """
    from inference.gpu_health import is_sick
    from inference.nvidia_smi import discover

    from .models import Node
    from .services import node_apply_driver_discovery
    from .signals import gpus_sick

    node = Node.objects.get(name=node_name)
    gpus = node_apply_driver_discovery(node=node, discovery=discover())
    # A GPU discovery marked lost (the driver answered nothing for it) drains like a sick sample.
    if any(is_sick(gpu.health_state) for gpu in gpus):
        gpus_sick.send(sender=Node, node=node)
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


@shared_task(name="inventory.agent_heartbeat", acks_late=False, ignore_result=True)
@skip_missing_row("inventory.Node", arg="node_name", field="name")
def agent_heartbeat(node_name: str) -> None:
    """Answer the portal's heartbeat: record that this node's agent is listening, and what it runs.

    Runs on the node itself (its own queue), so only a live agent can answer; expired messages
    (an agent that was down) are dropped, never answered late.
    """
    import platform

    import celery

    from portal.core.version import portal_commit, portal_version

    from .services import node_record_heartbeat

    node_record_heartbeat(
        node_name=node_name,
        versions={
            "portal": portal_version(),
            "commit": portal_commit(),
            "python": platform.python_version(),
            "celery": celery.__version__,
            "host": platform.node(),
        },
    )


@shared_task(name="inventory.heartbeat_all", ignore_result=True)
def heartbeat_all() -> int:
    """Beat, on `control`: send every node's agent a heartbeat; returns how many were sent.

    A node whose agent is not listening and whose queue already holds a message gets none: with
    no agent, nothing takes (or drops) the expired ones, and the queue would grow by one per tick
    for as long as the node has no agent. The agent answers at start anyway (`worker_ready`).
    """
    from portal.celery import app

    from .dispatch import send_to_node
    from .models import Node

    sent = 0
    with app.connection_for_write() as connection:
        channel = connection.default_channel
        for node in Node.objects.only("name", "agent_seen_at"):
            silent = not node.agent.listening and not app.conf.task_always_eager
            # kombu's stubs type the channel as StdChannel, which lacks the transport's queue_declare.
            declare = channel.queue_declare  # type: ignore[attr-defined]
            if silent and declare(queue=node.queue, passive=False).message_count:
                continue
            # A heartbeat answered late would say a dead agent is alive: it lives one interval.
            send_to_node(
                node,
                "inventory.agent_heartbeat",
                args=[node.name],
                expires_s=settings.NODE_HEARTBEAT_INTERVAL_S,
            )
            sent += 1
    return sent


@worker_ready.connect
def heartbeat_on_start(sender=None, **_kwargs) -> None:
    """An agent answers at once when it starts, so its node shows it listening without waiting
    for the next beat tick (and a stale "no agent" goes as soon as the agent is back)."""
    try:
        queues = [queue.name for queue in sender.task_consumer.queues]
    except AttributeError:
        return
    for name in queues:
        if name.startswith("node."):
            agent_heartbeat.run(name.removeprefix("node."))


@shared_task(name="inventory.sample_gpu_health", ignore_result=True)
@skip_missing_row("inventory.Node", arg="node_name", field="name")
def sample_gpu_health(node_name: str) -> dict | None:
    """Read this machine's GPU telemetry and kernel log, judge each GPU, and keep the minute's readings.

    Must run on the node itself. Each command is bounded by GPU_HEALTH_COMMAND_TIMEOUT_S. When a GPU
    is degraded or lost, it sends `gpus_sick` (portal/inventory/signals.py): deployments drains the
    deployments on it.
    """
    from inference.gpu_health import is_sick, read_sample

    from .models import Node
    from .services import node_record_gpu_health
    from .signals import gpus_sick

    node = Node.objects.get(name=node_name)
    sample = read_sample(timeout_s=settings.GPU_HEALTH_COMMAND_TIMEOUT_S)
    changes = node_record_gpu_health(node=node, sample=sample)
    if any(is_sick(state) for state in node.gpus.values_list("health_state", flat=True)):
        gpus_sick.send(sender=Node, node=node)
    return {
        "gpus": len(sample.gpus),
        "error": sample.error,
        "unavailable": sample.unavailable,
        "seconds": round(sample.seconds, 4),
        "changes": [(c.index, c.before, c.after) for c in changes],
    }


@shared_task(name="inventory.sample_gpu_health_all", ignore_result=True)
def sample_gpu_health_all() -> int:
    """Beat: ask the agent of every node with GPUs for a health sample.

    Simulated nodes (engine `sim`, e.g. the demo's) have GPUs as entered and no nvidia-smi: skipped,
    so their queues do not fill with samples nobody takes."""
    from .dispatch import send_to_node
    from .models import Node

    nodes = Node.objects.filter(gpus__isnull=False).exclude(engine="sim").distinct()
    # The next tick replaces a sample that waited longer than two intervals.
    expires_s = 2 * settings.GPU_HEALTH_SAMPLE_INTERVAL_S
    for node in nodes:
        send_to_node(node, "inventory.sample_gpu_health", args=[node.name], expires_s=expires_s)
    return len(nodes)
