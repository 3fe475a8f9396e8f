"""GPU telemetry on /metrics under DCGM's names (dcgm-exporter's `DCGM_FI_DEV_X` as `portal_dcgm_fi_dev_x`),
so dashboards and alert rules written for the DCGM exporter carry over; plus the portal's own
health-state gauge. Read from each GPU's latest per-minute sample (portal/inventory/models.py GpuSample);
a GPU whose latest sample is older than three sampling intervals exports its state and sample time only."""

from __future__ import annotations

import datetime as dt

from django.conf import settings
from django.utils import timezone
from prometheus_client.core import GaugeMetricFamily

from inference.gpu_health import THROTTLE_REASONS
from portal.inventory.models import Gpu, GpuHealth, GpuSample

PREFIX = "portal_"
LABELS = ["node", "gpu", "UUID", "modelName"]
_REASON_BITS = {name: bit for bit, name in THROTTLE_REASONS.items()}

# (DCGM field, help, GpuSample attribute)
FIELDS = (
    ("DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %).", "utilization_pct"),
    ("DCGM_FI_DEV_FB_USED", "Framebuffer memory used (in MiB).", "memory_used_mib"),
    ("DCGM_FI_DEV_GPU_TEMP", "GPU temperature (in C).", "temperature_c"),
    ("DCGM_FI_DEV_POWER_USAGE", "Power draw (in W).", "power_draw_w"),
    ("DCGM_FI_DEV_POWER_MGMT_LIMIT", "Power management limit (in W).", "power_limit_w"),
    ("DCGM_FI_DEV_SM_CLOCK", "SM clock frequency (in MHz).", "sm_clock_mhz"),
    ("DCGM_FI_DEV_MEM_CLOCK", "Memory clock frequency (in MHz).", "memory_clock_mhz"),
    ("DCGM_FI_DEV_CLOCK_THROTTLE_REASONS", "Active clock throttle reasons (bitmask).", "throttle_reasons"),
    ("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", "Corrected ECC errors since the last reset.", "ecc_corrected_volatile"),
    ("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "Uncorrectable ECC errors since reset.", "ecc_uncorrected_volatile"),
    ("DCGM_FI_DEV_ECC_SBE_AGG_TOTAL", "Corrected ECC errors over the GPU's life.", "ecc_corrected_aggregate"),
    ("DCGM_FI_DEV_ECC_DBE_AGG_TOTAL", "Uncorrectable ECC errors, lifetime.", "ecc_uncorrected_aggregate"),
    ("DCGM_FI_DEV_RETIRED_SBE", "Pages retired for single-bit errors.", "retired_pages_single_bit"),
    ("DCGM_FI_DEV_RETIRED_DBE", "Pages retired for double-bit errors.", "retired_pages_double_bit"),
    ("DCGM_FI_DEV_RETIRED_PENDING", "1 while a page retirement waits for a reset.", "retired_pages_pending"),
    ("DCGM_FI_DEV_ROW_REMAP_PENDING", "1 while a row remapping waits for a reset.", "remapped_rows_pending"),
    ("DCGM_FI_DEV_ROW_REMAP_FAILURE", "1 when a row could not be remapped.", "remapped_rows_failure"),
    ("DCGM_FI_DEV_PCIE_LINK_GEN", "PCIe link generation now.", "pcie_gen"),
    ("DCGM_FI_DEV_PCIE_MAX_LINK_GEN", "Highest PCIe link generation.", "pcie_gen_max"),
    ("DCGM_FI_DEV_PCIE_LINK_WIDTH", "PCIe link width now (lanes).", "pcie_width"),
    ("DCGM_FI_DEV_PCIE_MAX_LINK_WIDTH", "Widest PCIe link (lanes).", "pcie_width_max"),
)


def _read(sample: GpuSample, attribute: str) -> float | None:
    if attribute == "throttle_reasons":  # stored by name; DCGM exports nvml's bitmask
        return sum(_REASON_BITS.get(name, 0) for name in sample.throttle_reasons)
    value = getattr(sample, attribute)
    return None if value is None else float(value)


def gpu_families(now: dt.datetime | None = None) -> list[GaugeMetricFamily]:
    now = now or timezone.now()
    fresh_after = now - dt.timedelta(seconds=3 * settings.GPU_HEALTH_SAMPLE_INTERVAL_S)
    gpus = list(Gpu.objects.select_related("node").order_by("node__name", "index"))
    latest: dict[int, GpuSample] = {}
    for sample in GpuSample.objects.filter(at__gte=fresh_after, answered=True).order_by("gpu_id", "minute"):
        latest[sample.gpu_id] = sample  # the last one of each GPU wins

    def labels(gpu: Gpu) -> list[str]:
        return [gpu.node.name, str(gpu.index), gpu.uuid, gpu.name]

    families = []
    for field, help_text, attribute in FIELDS:
        family = GaugeMetricFamily(PREFIX + field.lower(), help_text, labels=LABELS)
        for gpu in gpus:
            found = latest.get(gpu.pk)
            value = None if found is None else _read(found, attribute)
            if value is not None:
                family.add_metric(labels(gpu), float(value))
        families.append(family)
    health = GaugeMetricFamily(
        PREFIX + "gpu_health",
        "1 for the GPU's health state from its last sample (healthy, warning, degraded, lost, unknown).",
        labels=[*LABELS, "state"],
    )
    checked = GaugeMetricFamily(
        PREFIX + "gpu_health_checked_timestamp_seconds", "Last sample (Unix time).", labels=LABELS
    )
    for gpu in gpus:
        for state in GpuHealth.values:
            health.add_metric([*labels(gpu), state], 1 if gpu.health_state == state else 0)
        if gpu.health_checked_at is not None:
            checked.add_metric(labels(gpu), gpu.health_checked_at.timestamp())
    return [*families, health, checked]
