"""Rehearsing a GPU failure on a simulated node (`manage.py inject_gpu_fault`, issue 38).

A simulated node has no nvidia-smi, so nothing samples it; this writes one sample into its readings
through the service the real sampler uses (`node_record_gpu_health`, then `gpus_sick` as the task
`inventory.sample_gpu_health` sends it): the node page shows the finding, and a degraded or lost GPU
starts the automatic move of the deployments on it. A real node's readings are its agent's only.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import enum

from django.conf import settings
from django.utils import timezone

from inference.gpu_health import GpuTelemetry, Sample, XidEvent, is_sick
from portal.core.errors import ApplicationError

from .models import Gpu, Node
from .services import HealthChange, node_record_gpu_health
from .signals import gpus_sick


class GpuFault(enum.StrEnum):
    XID79 = "xid79"  # fell off the bus: the GPU stops answering and the kernel logs Xid 79 (lost)
    ECC = "ecc"  # uncorrectable ECC errors since the last reset (degraded)
    HOT = "hot"  # above GPU_HEALTH_TEMPERATURE_WARNING_C (a warning: nothing moves)


def _healthy(gpu: Gpu) -> GpuTelemetry:
    """What a healthy, idle GPU answers; None where nothing is judged from it."""
    # Readings without a default are unknown (None); the rest keep theirs (no unknown fields, no
    # driver tokens).
    names = [
        field.name
        for field in dataclasses.fields(GpuTelemetry)
        if field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING
    ]
    reading: dict = dict.fromkeys(names)
    reading.update(
        index=gpu.index,
        uuid=gpu.uuid,
        pci_bus_id=gpu.pci_bus_id,
        name=gpu.name,
        temperature_c=40.0,
        ecc_uncorrected_volatile=0,
        throttle_mask=0,
    )
    return GpuTelemetry(**reading)


def gpu_fault_inject(
    *, node: Node, gpu_index: int, fault: GpuFault, at: dt.datetime | None = None
) -> list[HealthChange]:
    """Record one sample of `node` in which GPU `gpu_index` shows `fault` and every other GPU is
    healthy; returns the GPUs whose state changed."""
    if node.engine != "sim":
        raise ApplicationError(
            f"{node.name} is not a simulated node: its agent samples its GPUs with nvidia-smi, and "
            "its readings are those only",
            field="node",
        )
    gpus = list(node.gpus.order_by("index"))
    if gpu_index not in {gpu.index for gpu in gpus}:
        indexes = ", ".join(str(gpu.index) for gpu in gpus) or "none"
        raise ApplicationError(f"{node.name} has no GPU {gpu_index} (its GPUs: {indexes})", field="gpu")
    at = at or timezone.now()
    readings: list[GpuTelemetry] = []
    xids: list[XidEvent] = []
    for gpu in gpus:
        reading = _healthy(gpu)
        if gpu.index == gpu_index:
            if fault is GpuFault.XID79:
                xids.append(XidEvent(gpu.pci_bus_id, 79, "GPU has fallen off the bus. (injected)", at))
                continue  # a GPU off the bus does not answer nvidia-smi either
            if fault is GpuFault.ECC:
                reading = dataclasses.replace(reading, ecc_uncorrected_volatile=2)
            if fault is GpuFault.HOT:
                reading = dataclasses.replace(
                    reading, temperature_c=float(settings.GPU_HEALTH_TEMPERATURE_WARNING_C) + 5
                )
        readings.append(reading)
    changes = node_record_gpu_health(node=node, sample=Sample(at=at, gpus=tuple(readings), xids=tuple(xids)))
    if any(is_sick(state) for state in node.gpus.values_list("health_state", flat=True)):
        gpus_sick.send(sender=Node, node=node)
    return changes
