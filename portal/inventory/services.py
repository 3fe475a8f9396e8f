"""Writes to the inventory: nodes and what discovery found on them."""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from inference.env_probe import EnvFacts, probe_environment
from inference.errors import InputError
from inference.gpu_health import GpuContext, GpuVerdict, HealthThresholds, Sample, evaluate, is_sick
from inference.hardware import match_gpu
from inference.nvidia_smi import QUERY_COMMAND as NVIDIA_SMI_QUERY_COMMAND
from inference.nvidia_smi import (
    Discovery,
    GpuReading,
    Topology,
    parse_query_csv,
    parse_topology,
    read_query_csv,
)
from portal.audit.services import audit_event_record
from portal.core.errors import ApplicationError, clean_or_raise

from .models import Gpu, GpuHealth, GpuSample, Interconnect, Node


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


# What discovery may change on a GPU row it finds again; health is the sampler's, except that
# a GPU discovery had marked lost (or a different card in the slot) starts afresh as unknown.
_DISCOVERED_FIELDS = (
    "name",
    "catalog_key",
    "uuid",
    "pci_bus_id",
    "memory_mib",
    "compute_capability",
    "bandwidth_gb_s",
    "fp16_tflops",
    "nvlink_peers",
)
DISCOVERY_LOST_CODE = "discovery_no_answer"


def _gpu_mark_lost(gpu: Gpu, why: str, now) -> None:
    """Discovery could not see the GPU: lost, saying why, rather than deleted with its history."""
    if gpu.health_state != GpuHealth.LOST:
        gpu.health_since = now
    gpu.health_state = GpuHealth.LOST
    gpu.health_findings = [{"level": GpuHealth.LOST.value, "code": DISCOVERY_LOST_CODE, "message": why}]
    gpu.health_checked_at = now
    gpu.save(update_fields=["health_state", "health_findings", "health_since", "health_checked_at"])


def _gpu_refresh(old: Gpu, found: Gpu, now) -> None:
    other_card = bool(old.uuid) and old.uuid != found.uuid
    was_lost = any(f.get("code") == DISCOVERY_LOST_CODE for f in old.health_findings or [])
    for name in _DISCOVERED_FIELDS:
        setattr(old, name, getattr(found, name))
    clean_or_raise(old)
    fields = list(_DISCOVERED_FIELDS)
    if other_card or was_lost:
        old.health_state, old.health_findings, old.health_since = GpuHealth.UNKNOWN, [], now
        old.throttled_since = None
        fields += ["health_state", "health_findings", "health_since", "throttled_since"]
    old.save(update_fields=fields)


@transaction.atomic
def node_apply_discovery(
    *,
    node: Node,
    readings: list[GpuReading],
    topology: Topology,
    topology_text: str = "",
    notes: Sequence[str] = (),
    unread: Mapping[int, str] | None = None,
    keep_missing: bool = False,
) -> list[Gpu]:
    """Record what discovery found: each GPU read is created or refreshed in place (its health
    history stays), all or nothing.

    A GPU row discovery did not read is deleted when the text replaces the node's GPUs (a paste,
    `keep_missing` False); from a node's own driver (`keep_missing` True) it is kept and marked
    lost, with the reason from `unread` (its unreadable row) or "not listed".
    """
    gpus = gpus_from_readings(readings, topology)
    node = Node.objects.select_for_update().get(pk=node.pk)
    now = timezone.now()
    existing = {gpu.index: gpu for gpu in node.gpus.all()}
    found = {gpu.index for gpu in gpus}
    for index in sorted(set(existing) - found):
        gone = existing.pop(index)
        if keep_missing:
            why = (unread or {}).get(index) or "nvidia-smi did not list it at the last discovery"
            _gpu_mark_lost(gone, f"discovery: {why}", now)
        else:
            gone.delete()
    for gpu in gpus:
        gpu.node = node
        if gpu.index in existing:
            _gpu_refresh(existing[gpu.index], gpu, now)
        else:
            clean_or_raise(gpu)
            gpu.save()
    if gpus or not keep_missing:
        node.interconnect = topology.interconnect_summary() if gpus else Interconnect.NONE
        node.driver_version = next((r.driver_version for r in readings if r.driver_version), "")
    if topology_text or not keep_missing:
        node.topology_text = topology_text
    node.discovery_notes = list(notes)
    node.discovered_at = now
    node.save(
        update_fields=["interconnect", "driver_version", "topology_text", "discovery_notes", "discovered_at"]
    )
    return list(node.gpus.order_by("index"))


def node_apply_driver_discovery(*, node: Node, discovery: Discovery) -> list[Gpu]:
    """Record what the node's own driver said (the agent's `inventory.discover_gpus`).

    The driver answering nothing (down, "No devices were found" after an Xid 79) never deletes
    the node's GPUs: they are marked lost and say why. An unreadable row costs only its GPU.
    """
    unread = {p.index: p.message for p in discovery.problems if p.index is not None}
    why = discovery.no_answer and f"the driver listed no GPUs ({discovery.no_answer})"
    unread_all = dict.fromkeys(node.gpus.values_list("index", flat=True), why) if why else {}
    return node_apply_discovery(
        node=node,
        readings=list(discovery.readings),
        topology=discovery.topology,
        topology_text=discovery.topology_text,
        notes=discovery.notes(),
        unread={**unread_all, **unread},
        keep_missing=True,
    )


def _is_nvidia_smi_table(text: str) -> bool:
    """Plain `nvidia-smi` (its boxed table), pasted where the CSV of the query belongs (issue 38)."""
    return "NVIDIA-SMI" in text or any(line.lstrip().startswith(("+---", "|=")) for line in text.splitlines())


def nvidia_smi_text_problems(*, query_csv: str, topology_text: str = "") -> dict[str, str]:
    """Every part of pasted nvidia-smi output that does not parse, by form field, so the page shows
    them all at once rather than one per submit (issue 38). Empty: both parse (or neither is given)."""
    problems: dict[str, str] = {}
    if query_csv.strip():
        try:
            nvidia_smi_text_parse(query_csv=query_csv)
        except ApplicationError as error:
            problems[error.field or "nvidia_smi_query"] = error.message
    if topology_text.strip():
        if not query_csv.strip():
            problems["nvidia_smi_topology"] = (
                "the topology needs the GPU list (CSV) beside it; paste both or leave it out"
            )
        else:
            try:
                parse_topology(topology_text)
            except InputError as error:
                problems["nvidia_smi_topology"] = (
                    f"topology (`nvidia-smi topo -m`): {error.message}; fix it or leave it out"
                )
    return problems


def nvidia_smi_text_parse(*, query_csv: str, topology_text: str = "") -> tuple[list[GpuReading], Topology]:
    """Parse pasted nvidia-smi output, naming the part that failed: `nvidia_smi_query` (the CSV,
    including a GPU the catalog lacks) or `nvidia_smi_topology` (`topo -m`). Nothing is written."""
    if _is_nvidia_smi_table(query_csv):
        raise ApplicationError(
            "GPU list (CSV): this is `nvidia-smi`'s table, not its CSV; run "
            f"`{' '.join(NVIDIA_SMI_QUERY_COMMAND)}` on the node and paste what it prints",
            field="nvidia_smi_query",
        )
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
    """Parse pasted or uploaded nvidia-smi output, then apply it (the hand-entry path).

    Output that says the driver answered nothing ("No devices were found") keeps the node's GPUs,
    marked lost, as from the node's own driver: it is no statement that the node has no GPUs."""
    try:
        no_answer = read_query_csv(query_csv).no_answer if query_csv.strip() else ""
    except InputError:
        no_answer = ""  # a malformed text: parse_query_csv below says what is wrong
    if no_answer:
        return node_apply_driver_discovery(node=node, discovery=Discovery(no_answer=no_answer))
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
            vllm_kernel_archs=facts.kernel_archs,
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


# --- GPU health (inference/gpu_health/) ---------------------------------------------------------


@dataclass(frozen=True)
class HealthChange:
    """A GPU whose state the sample changed."""

    gpu_id: int
    index: int
    before: str
    after: str


def health_thresholds() -> HealthThresholds:
    return HealthThresholds(
        throttle_minutes=settings.GPU_HEALTH_THROTTLE_MINUTES,
        temperature_warning_c=settings.GPU_HEALTH_TEMPERATURE_WARNING_C,
        xid_window_minutes=settings.GPU_HEALTH_XID_WINDOW_MINUTES,
    )


def _finite(values: dict) -> dict:
    """No inf/nan reaches the database: the parser already reads them as unknown, and this keeps it
    so for any other caller (a stored inf once made the node page fail for the chart's six hours)."""
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in values.items()}


def _sample_values(verdict: GpuVerdict) -> dict:
    reading = verdict.reading
    if reading is None:
        return {"answered": False, "throttle_reasons": []}
    return {
        "answered": True,
        "utilization_pct": reading.utilization_gpu_pct,
        "memory_used_mib": reading.memory_used_mib,
        "temperature_c": reading.temperature_c,
        "power_draw_w": reading.power_draw_w,
        "power_limit_w": reading.power_limit_w,
        "sm_clock_mhz": reading.sm_clock_mhz,
        "memory_clock_mhz": reading.memory_clock_mhz,
        "throttle_reasons": list(reading.throttle_reasons),
        "ecc_corrected_volatile": reading.ecc_corrected_volatile,
        "ecc_uncorrected_volatile": reading.ecc_uncorrected_volatile,
        "ecc_corrected_aggregate": reading.ecc_corrected_aggregate,
        "ecc_uncorrected_aggregate": reading.ecc_uncorrected_aggregate,
        "retired_pages_single_bit": reading.retired_pages_single_bit,
        "retired_pages_double_bit": reading.retired_pages_double_bit,
        "retired_pages_pending": reading.retired_pages_pending,
        "remapped_rows_pending": reading.remapped_rows_pending,
        "remapped_rows_failure": reading.remapped_rows_failure,
        "pcie_gen": reading.pcie_gen,
        "pcie_gen_max": reading.pcie_gen_max,
        "pcie_width": reading.pcie_width,
        "pcie_width_max": reading.pcie_width_max,
        "persistence_mode": reading.persistence_mode,
    }


@transaction.atomic
def node_record_gpu_health(*, node: Node, sample: Sample) -> list[HealthChange]:
    """Judge every GPU of `node` from one telemetry sample, keep the minute's readings, and set each
    GPU's health state and findings; returns the GPUs whose state changed.

    A machine without nvidia-smi (`sample.unavailable`) changes nothing: nothing can be said.
    """
    if sample.unavailable:
        return []
    limits = health_thresholds()
    minute = sample.at.replace(second=0, microsecond=0)
    changes: list[HealthChange] = []
    for gpu in Gpu.objects.select_for_update().filter(node=node).order_by("index"):
        context = GpuContext(
            index=gpu.index,
            pci_bus_id=gpu.pci_bus_id,
            throttled_since=gpu.throttled_since,
            cleared_at=gpu.health_cleared_at,
        )
        verdict = evaluate(context, sample, limits=limits)
        GpuSample.objects.update_or_create(
            gpu=gpu,
            minute=minute,
            defaults={"at": sample.at, "state": verdict.state, **_finite(_sample_values(verdict))},
        )
        before = gpu.health_state
        gpu.health_findings = verdict.findings_dicts()
        gpu.health_checked_at = sample.at
        gpu.throttled_since = verdict.throttled_since
        if verdict.state != before:
            gpu.health_state = verdict.state
            gpu.health_since = sample.at
            changes.append(HealthChange(gpu.pk, gpu.index, before, verdict.state))
        gpu.save(
            update_fields=[
                "health_state",
                "health_findings",
                "health_checked_at",
                "health_since",
                "throttled_since",
            ]
        )
    for change in changes:
        if is_sick(change.after) or is_sick(change.before):
            audit_event_record(
                action="gpu.health",
                target_type="inventory.gpu",
                target_id=str(change.gpu_id),
                target_repr=f"{node.name}:{change.index}",
                changes={"health_state": [change.before, change.after]},
            )
    return changes


@transaction.atomic
def gpu_mark_healthy(*, gpu: Gpu, user=None) -> Gpu:
    """An operator says the GPU was reset (or the node rebooted): it takes work again.

    The next sample judges it afresh; Xid events logged before now are history from then on.
    A GPU still failing turns degraded or lost again at that sample.
    """
    gpu = Gpu.objects.select_for_update().get(pk=gpu.pk)
    before = gpu.health_state
    now = timezone.now()
    gpu.health_state = GpuHealth.HEALTHY
    gpu.health_findings = []
    gpu.health_since = now
    gpu.health_cleared_at = now
    gpu.throttled_since = None
    fields = ["health_state", "health_findings", "health_since", "health_cleared_at", "throttled_since"]
    gpu.save(update_fields=fields)
    audit_event_record(
        action="gpu.mark_healthy",
        target=gpu,
        actor=user,
        changes={"health_state": [before, GpuHealth.HEALTHY]},
    )
    return gpu


class AgentRequest(enum.StrEnum):
    """What the node page's buttons (and the API's actions) ask a node's agent for."""

    DISCOVER = "discover"  # read the GPUs with nvidia-smi
    PROBE_ENGINE = "probe-engine"  # report the vLLM environment (vLLM, torch, CUDA, kernels)


_AGENT_TASKS = {
    AgentRequest.DISCOVER: ("inventory.discover_gpus", "node.discover"),
    AgentRequest.PROBE_ENGINE: ("inventory.probe_software", "node.probe_software"),
}


def node_ask_agent(*, node: Node, request: AgentRequest, user=None) -> str:
    """Send `request` to the node's agent (audited); returns the task id. The answer lands on the
    node's page when the agent has run it."""
    from .dispatch import send_to_node

    task, action = _AGENT_TASKS[request]
    task_id = send_to_node(node, task, args=[node.name])
    audit_event_record(action=action, target=node, actor=user, changes={"task_id": task_id})
    return task_id
