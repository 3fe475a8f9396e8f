"""Writes to the inventory: nodes and what discovery found on them."""

from __future__ import annotations

from django.db import transaction
from django.utils import timezone

from inference.env_probe import EnvFacts, probe_environment
from inference.errors import InputError
from inference.hardware import match_gpu
from inference.nvidia_smi import GpuReading, Topology, parse_query_csv, parse_topology
from portal.core.errors import ApplicationError, clean_or_raise

from .models import Gpu, Interconnect, Node


def node_create(*, name: str, hostname: str = "", description: str = "", vllm_python: str = "") -> Node:
    node = Node(name=name, hostname=hostname, description=description, vllm_python=vllm_python)
    clean_or_raise(node)
    node.save()
    return node


def gpus_from_readings(readings: list[GpuReading], topology: Topology) -> list[Gpu]:
    """Unsaved Gpu rows for what nvidia-smi reported, with catalog facts filled in."""
    gpus = []
    for reading in readings:
        spec = match_gpu(reading.name, reading.memory_total_mib)
        if spec is None:
            raise ApplicationError(
                f"GPU {reading.index} '{reading.name}' is not in the GPU catalog; "
                "enter it by hand with its memory bandwidth and FP16 peak.",
                field="gpus",
            )
        gpus.append(
            Gpu(
                index=reading.index,
                name=reading.name,
                catalog_key=spec.key,
                uuid=reading.uuid,
                pci_bus_id=reading.pci_bus_id,
                memory_mib=reading.memory_total_mib,
                compute_capability=reading.compute_capability or spec.compute_capability,
                bandwidth_gb_s=spec.bandwidth_gb_s,
                fp16_tflops=spec.fp16_tflops,
                nvlink_peers=topology.nvlink_peers(reading.index),
            )
        )
    return gpus


@transaction.atomic
def node_apply_discovery(
    *, node: Node, readings: list[GpuReading], topology: Topology, topology_text: str = ""
) -> list[Gpu]:
    """Replace the node's GPUs with what discovery found, all or nothing."""
    gpus = gpus_from_readings(readings, topology)
    node = Node.objects.select_for_update().get(pk=node.pk)
    node.gpus.all().delete()
    for gpu in gpus:
        gpu.node = node
        clean_or_raise(gpu)
    Gpu.objects.bulk_create(gpus)
    node.interconnect = topology.interconnect_summary() if gpus else Interconnect.NONE
    node.driver_version = next((r.driver_version for r in readings if r.driver_version), "")
    node.topology_text = topology_text
    node.discovered_at = timezone.now()
    node.save(update_fields=["interconnect", "driver_version", "topology_text", "discovered_at"])
    return gpus


def nvidia_smi_text_parse(*, query_csv: str, topology_text: str = "") -> tuple[list[GpuReading], Topology]:
    """Parse pasted nvidia-smi output, naming the part that failed: `nvidia_smi_query` (the CSV,
    including a GPU the catalog lacks) or `nvidia_smi_topology` (`topo -m`). Nothing is written."""
    try:
        readings = parse_query_csv(query_csv)
        gpus_from_readings(readings, Topology(links={}))  # every GPU must be in the catalog
    except InputError as error:
        raise ApplicationError(f"GPU list (CSV): {error.message}", field="nvidia_smi_query") from error
    except ApplicationError as error:
        raise ApplicationError(f"GPU list (CSV): {error.message}", field="nvidia_smi_query") from error
    if not topology_text.strip():
        return readings, Topology(links={})
    try:
        return readings, parse_topology(topology_text)
    except InputError as error:
        raise ApplicationError(
            f"topology (`nvidia-smi topo -m`): {error.message}; fix it or leave it out",
            field="nvidia_smi_topology",
        ) from error


def node_apply_nvidia_smi_text(*, node: Node, query_csv: str, topology_text: str = "") -> list[Gpu]:
    """Parse pasted or uploaded nvidia-smi output, then apply it (the hand-entry path)."""
    try:
        readings = parse_query_csv(query_csv)
        topology = parse_topology(topology_text) if topology_text.strip() else Topology(links={})
    except InputError as error:
        raise ApplicationError.from_input_error(error) from error
    return node_apply_discovery(node=node, readings=readings, topology=topology, topology_text=topology_text)


@transaction.atomic
def node_create_from_nvidia_smi(
    *,
    name: str,
    hostname: str = "",
    description: str = "",
    vllm_python: str = "",
    query_csv: str = "",
    topology_text: str = "",
) -> Node:
    """A node and, when pasted, its GPUs (the "Add a node" page): both parts parse, or nothing is saved."""
    if topology_text.strip() and not query_csv.strip():
        raise ApplicationError(
            "the topology needs the GPU list (CSV) beside it; paste both or leave it out",
            field="nvidia_smi_topology",
        )
    parsed = None
    if query_csv.strip():
        parsed = nvidia_smi_text_parse(query_csv=query_csv, topology_text=topology_text)
    node = node_create(name=name, hostname=hostname, description=description, vllm_python=vllm_python)
    if parsed is not None:
        readings, topology = parsed
        node_apply_discovery(node=node, readings=readings, topology=topology, topology_text=topology_text)
    return node


def node_record_heartbeat(*, node_name: str, versions: dict[str, str]) -> None:
    """The node's agent answered a heartbeat now; `versions` is what it runs (each value bounded)."""
    bounded = {str(k)[:40]: str(v)[:100] for k, v in list(versions.items())[:20]}
    Node.objects.filter(name=node_name).update(agent_seen_at=timezone.now(), agent_versions=bounded)


def node_record_software(*, node: Node, facts: EnvFacts | None, python: str, error: str = "") -> Node:
    """Store what the probe of the node's vLLM environment found (or why it failed)."""
    values = {
        "software_python": python,
        "software_probed_at": timezone.now(),
        "software_error": error,
    }
    if facts is not None:
        values.update(
            vllm_version=facts.vllm_version,
            torch_version=facts.torch_version,
            torch_cuda_version=facts.torch_cuda_version,
            torch_arch_list=facts.arch_list,
        )
    Node.objects.filter(pk=node.pk).update(**values)
    for name, value in values.items():
        setattr(node, name, value)
    return node


def node_probe_software(*, node: Node) -> EnvFacts:
    """Run the probe with the node's vLLM Python (on the node itself) and record the result.

    Raises ApplicationError (field `vllm_python`) when the environment is missing or broken;
    the error is recorded on the node too, so its page says why.
    """
    try:
        facts = probe_environment(node.vllm_python)
    except InputError as error:
        node_record_software(node=node, facts=None, python=node.vllm_python, error=error.message)
        raise ApplicationError.from_input_error(error) from error
    node_record_software(node=node, facts=facts, python=node.vllm_python)
    return facts
