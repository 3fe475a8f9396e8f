"""The health rules: one sample (and the GPU's recent past) in, one verdict per GPU out.

In the style of the planner's rules (inference/rules.py): one function per finding, each saying
which reading, when, and what to do. States, worst first: `lost` (it does not answer, or fell off
the bus), `degraded` (it answers but is not to be trusted until a reset), `warning` (it works,
slower or at risk), `unknown` (a reading that matters could not be taken), `healthy`. A node is
never judged as a whole for one card's sake: each GPU's verdict reads its own row and its own Xids,
and the only node-wide rule (a clock clamp on every GPU under load) needs every GPU to show it.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from enum import StrEnum

from .kernel_log import XidEvent, same_pci_device
from .sampling import Sample
from .telemetry import GpuTelemetry
from .xid import XID_TABLE, judge_xid


class HealthState(StrEnum):
    HEALTHY = "healthy"
    WARNING = "warning"
    DEGRADED = "degraded"
    LOST = "lost"
    UNKNOWN = "unknown"


# The state of a GPU is its worst finding's level; `info` findings change nothing.
_SEVERITY = {
    HealthState.LOST: 4,
    HealthState.DEGRADED: 3,
    HealthState.WARNING: 2,
    HealthState.UNKNOWN: 1,
    HealthState.HEALTHY: 0,
}
SICK_STATES = frozenset({HealthState.DEGRADED, HealthState.LOST})

# nvml.h: 0x20/0x40 are thermal; 0x80 is the board's power brake (an external signal: PSU or
# platform), and 0x8 is the umbrella bit the driver sets with either of 0x40 and 0x80.
THERMAL_REASONS = frozenset({"sw_thermal_slowdown", "hw_thermal_slowdown"})
POWER_REASONS = frozenset({"sw_power_cap", "hw_power_brake_slowdown"})
# A card drawing at least this share of its power limit while sw_power_cap is set is simply running
# at its limit under load: normal, not a fault.
AT_POWER_LIMIT = 0.95
# A node-wide clamp: every GPU busy (utilization at least this) with its SM clock at most this
# share of its maximum while a hardware slowdown bit is set.
LOADED_PCT = 50.0
CLAMPED_CLOCK_SHARE = 0.5


@dataclass(frozen=True)
class HealthThresholds:
    """The settings the rules read (portal settings GPU_HEALTH_*; docs/configuration.md)."""

    throttle_minutes: float = 5.0  # thermal or power throttling this long in a row: warning
    temperature_warning_c: float = 85.0  # GPU core at or above this: warning
    xid_window_minutes: float = 60.0  # Xid events older than this are history, not a reading


@dataclass(frozen=True)
class HealthFinding:
    """One thing wrong with a GPU: `level` is the state it puts the GPU in (`info`: none)."""

    level: str  # "lost" | "degraded" | "warning" | "unknown" | "info"
    code: str
    message: str

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


@dataclass(frozen=True)
class GpuContext:
    """What the rules need beyond the current reading: the GPU's identity and its recent past."""

    index: int
    pci_bus_id: str
    # When the current run of thermal / power throttling began (from earlier samples); None: not throttled.
    throttled_since: dt.datetime | None = None
    # Xid events at or before this are known (an operator marked the GPU healthy after a reset).
    cleared_at: dt.datetime | None = None


@dataclass(frozen=True)
class GpuVerdict:
    index: int
    state: HealthState
    findings: tuple[HealthFinding, ...] = field(default_factory=tuple)
    throttled_since: dt.datetime | None = None
    reading: GpuTelemetry | None = None

    def findings_dicts(self) -> list[dict[str, str]]:
        return [f.to_dict() for f in self.findings]


def _when(at: dt.datetime) -> str:
    return at.astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _no_answer(gpu: GpuContext, sample: Sample) -> HealthFinding | None:
    if sample.unavailable or any(r.index == gpu.index for r in sample.gpus):
        return None
    own = [p for p in sample.problems if p.index == gpu.index]
    if not own:
        # A line that names no GPU, in an answer the driver gave without complaint (or one where it
        # printed its own verdict), is most likely the missing GPU's own row: never `lost` on a
        # parse error alone.
        own = [p for p in sample.problems if p.index is None and (p.says or not sample.error)]
    if own and gpu.index not in sample.lost and any("GPU requires reset" in p.says for p in own):
        return HealthFinding(
            "degraded",
            "driver_requires_reset",
            f"nvidia-smi printed [GPU requires reset] for GPU {gpu.index} at {_when(sample.at)} "
            f"({own[0].reason}): the driver will not trust it until then. Drain it and reset the GPU "
            "(nvidia-smi -r) or reboot the node.",
        )
    if own and gpu.index not in sample.lost:
        # The GPU answered; its line could not be read. That says nothing about the card.
        return HealthFinding(
            "unknown",
            "unreadable_row",
            f"GPU {gpu.index}'s reading at {_when(sample.at)} could not be read ({own[0].reason}): "
            "nothing is concluded about it until the next sample.",
        )
    if gpu.index in sample.lost:
        why = "nvidia-smi printed [GPU is lost] for it"
    else:
        why = sample.error or f"nvidia-smi listed {len(sample.gpus)} GPUs but not GPU {gpu.index}"
    return HealthFinding(
        "lost",
        "no_answer",
        f"GPU {gpu.index} did not answer at {_when(sample.at)}: {why}. It has fallen off the bus or "
        "the driver is hung; stop its work and reboot the node (a GPU reset rarely brings it back).",
    )


def _duplicate_row(gpu: GpuContext, sample: Sample) -> HealthFinding | None:
    repeats = [p for p in sample.problems if p.index == gpu.index and "repeats" in p.reason]
    if not repeats or not any(r.index == gpu.index for r in sample.gpus):
        return None
    return HealthFinding(
        "warning",
        "duplicate_row",
        f"nvidia-smi printed GPU {gpu.index} more than once at {_when(sample.at)} ({repeats[0].reason}): "
        "the driver's view of this node is inconsistent; check `nvidia-smi -L` and the kernel log.",
    )


def _driver_says(gpu: GpuContext, r: GpuTelemetry, at: dt.datetime) -> HealthFinding | None:
    if "GPU requires reset" not in r.driver_says:
        return None
    return HealthFinding(
        "degraded",
        "driver_requires_reset",
        f"nvidia-smi printed [GPU requires reset] for GPU {gpu.index} at {_when(at)}: the driver will "
        "not trust it until then. Drain it and reset the GPU (nvidia-smi -r) or reboot the node.",
    )


# nvidia-smi's short names for NVML's GPU recovery actions (`gpu_recovery_action`).
_RECOVERY_LEVELS = {
    "reset": ("degraded", "reset the GPU"),
    "drain and reset": ("degraded", "drain every workload from it, then reset the GPU"),
    "drain_and_reset": ("degraded", "drain every workload from it, then reset the GPU"),
    "reboot": ("lost", "drain the node and reboot it"),
    "node reboot": ("lost", "drain the node and reboot it"),
}


def _recovery_action(gpu: GpuContext, r: GpuTelemetry, at: dt.datetime) -> HealthFinding | None:
    if r.recovery_action is None or r.recovery_action.lower() == "none":
        return None
    level, fix = _RECOVERY_LEVELS.get(r.recovery_action.lower(), ("degraded", "reset the GPU"))
    return HealthFinding(
        level,
        "driver_recovery_action",
        f"The driver's recovery action for GPU {gpu.index} is {r.recovery_action} (gpu_recovery_action at "
        f"{_when(at)}): it takes no new work until then; {fix}.",
    )


def _unknown_readings(gpu: GpuContext, r: GpuTelemetry, at: dt.datetime) -> HealthFinding | None:
    if not r.unknown_fields:
        return None
    hidden = " (MIG hides them)" if r.mig_enabled else ""
    return HealthFinding(
        "unknown",
        "readings_unknown",
        f"GPU {gpu.index}'s {', '.join(r.unknown_fields)} could not be read at {_when(at)}{hidden}: the "
        "checks on them are unknown, not passed.",
    )


# Which checks each field feeds, to say what a driver that lacks it leaves unknown.
_CHECKS_BY_PREFIX = {
    "remapped_rows.": "row remapping",
    "retired_pages.": "page retirement",
    "ecc.": "ECC errors",
    "temperature.": "temperature",
    "clocks": "throttling",
    "power.": "power",
    "pcie.": "PCIe link width",
    "mig.": "MIG mode",
    "utilization.": "utilization",
}


def checks_for(fields: Iterable[str]) -> list[str]:
    """The checks (in words) that read any of `fields`."""
    checks = [next((c for p, c in _CHECKS_BY_PREFIX.items() if f.startswith(p)), f) for f in fields]
    return list(dict.fromkeys(checks))


def _unsupported_fields(gpu: GpuContext, sample: Sample) -> HealthFinding | None:
    if not sample.unsupported_fields:
        return None
    return HealthFinding(
        "info",
        "checks_unknown",
        f"This node's driver does not know {', '.join(sample.unsupported_fields)}: "
        f"{', '.join(checks_for(sample.unsupported_fields))} on GPU {gpu.index} are unknown.",
    )


def _xid_findings(gpu: GpuContext, xids: list[XidEvent]) -> list[HealthFinding]:
    """One finding per Xid code the GPU logged in the window, naming every event of it; the level is
    the worst any of them earned (the table, overridden by the driver's own flags)."""
    findings = []
    for code in dict.fromkeys(x.code for x in xids):
        events = [x for x in xids if x.code == code]
        judged = [judge_xid(x.code, x.detail) for x in events]
        worst = max(judged, key=lambda j: _SEVERITY[HealthState(j.level)])
        rule = XID_TABLE.get(code)
        times = ", ".join(_when(x.at) if x.at else "an unknown time" for x in events)
        level = "info" if worst.level == "healthy" else worst.level
        count = f"{len(events)} times" if len(events) > 1 else "once"
        findings.append(
            HealthFinding(
                level,
                f"xid_{code}",
                f"GPU {gpu.index} logged Xid {code} ({rule.name if rule else 'unknown to this portal'}) "
                f"{count}: at {times}; last: {events[-1].detail}. {worst.why}: {worst.action}.",
            )
        )
    return findings


def _uncorrectable_ecc(gpu: GpuContext, r: GpuTelemetry, at: dt.datetime) -> HealthFinding | None:
    if not r.ecc_uncorrected_volatile:
        return None
    return HealthFinding(
        "degraded",
        "ecc_uncorrectable",
        f"GPU {gpu.index} counted {r.ecc_uncorrected_volatile} uncorrectable ECC errors since its last "
        f"reset (ecc.errors.uncorrected.volatile.total at {_when(at)}). Results computed on it may be "
        "wrong: drain it and reset the GPU or reboot the node so the bad page is retired.",
    )


def _retirement_pending(gpu: GpuContext, r: GpuTelemetry, at: dt.datetime) -> HealthFinding | None:
    if not (r.retired_pages_pending or r.remapped_rows_pending):
        return None
    reading = "retired_pages.pending" if r.retired_pages_pending else "remapped_rows.pending"
    return HealthFinding(
        "degraded",
        "retirement_pending",
        f"GPU {gpu.index} has a memory page waiting to be retired ({reading} = Yes at {_when(at)}). "
        "It takes effect only at the next GPU reset: drain it, reset it or reboot the node.",
    )


def _remapping_failed(gpu: GpuContext, r: GpuTelemetry, at: dt.datetime) -> HealthFinding | None:
    if not r.remapped_rows_failure:
        return None
    return HealthFinding(
        "degraded",
        "remapping_failed",
        f"GPU {gpu.index} could not remap a failing memory row (remapped_rows.failure = Yes at "
        f"{_when(at)}): it has run out of spare rows. Take it out of service and have the card replaced.",
    )


def _at_power_limit(r: GpuTelemetry) -> bool:
    return (
        r.power_draw_w is not None
        and r.power_limit_w is not None
        and r.power_limit_w != 0
        and r.power_draw_w >= AT_POWER_LIMIT * r.power_limit_w
    )


def _throttle_kind(r: GpuTelemetry) -> str | None:
    """thermal | power_brake | hw_slowdown | power_cap, or None when nothing worth counting is set."""
    reasons = set(r.throttle_reasons)
    if reasons & THERMAL_REASONS:
        return "thermal"
    if "hw_power_brake_slowdown" in reasons:
        return "power_brake"
    if "hw_slowdown" in reasons:
        return "hw_slowdown"
    if "sw_power_cap" in reasons and not _at_power_limit(r):
        return "power_cap"
    return None  # idle, application clocks, sync boost, display, or simply running at its power limit


_FIXES = {
    "thermal": ("thermal_throttling", "check the fans, airflow and inlet temperature of the rack"),
    "power_brake": (
        "power_brake",
        "this is the board's power brake, a power/platform signal, not heat: check the PSU and the "
        "power brake signal of the chassis",
    ),
    "hw_slowdown": (
        "hw_slowdown",
        "the driver names no cause (thermal or power brake): check the temperature, the PSU and the "
        "power brake signal",
    ),
    "power_cap": (
        "power_throttling",
        "it is capped below its limit's draw: check the power limit (nvidia-smi -q -d POWER); a capped "
        "card runs slower",
    ),
}


def _throttling(
    gpu: GpuContext, r: GpuTelemetry, at: dt.datetime, limits: HealthThresholds
) -> tuple[HealthFinding | None, dt.datetime | None]:
    """Throttling worth counting: a finding once it lasted `throttle_minutes`; returns the onset."""
    kind = _throttle_kind(r)
    if kind is None:
        return None, None
    since = gpu.throttled_since or at
    minutes = (at - since).total_seconds() / 60
    if minutes < limits.throttle_minutes:
        return None, since
    code, fix = _FIXES[kind]
    return (
        HealthFinding(
            "warning",
            code,
            f"GPU {gpu.index} has been throttled ({', '.join(r.throttle_reasons)}) for {minutes:.0f} min, "
            f"since {_when(since)} (temperature {_show(r.temperature_c)} °C, power {_show(r.power_draw_w)} W "
            f"of {_show(r.power_limit_w)} W, SM clock {_show(r.sm_clock_mhz)} of {_show(r.max_sm_clock_mhz)} "
            f"MHz): {fix}.",
        ),
        since,
    )


def _show(value: float | None) -> str:
    return "?" if value is None else f"{value:g}"


def _clamped(r: GpuTelemetry) -> bool:
    return (
        bool({"hw_power_brake_slowdown", "hw_slowdown"} & set(r.throttle_reasons))
        and r.utilization_gpu_pct is not None
        and r.utilization_gpu_pct >= LOADED_PCT
        and r.sm_clock_mhz is not None
        and r.max_sm_clock_mhz is not None
        and r.max_sm_clock_mhz != 0
        and r.sm_clock_mhz <= CLAMPED_CLOCK_SHARE * r.max_sm_clock_mhz
    )


def _node_clock_clamp(gpu: GpuContext, r: GpuTelemetry, sample: Sample) -> HealthFinding | None:
    """Every GPU of the node busy with its SM clock held far below maximum by a hardware slowdown: a
    platform fault (power brake asserted by the chassis), not one card. Judged at once: at 86 of
    1,980 MHz the node serves nothing, however long it lasts."""
    if not _clamped(r) or not all(_clamped(other) for other in sample.gpus):
        return None
    return HealthFinding(
        "degraded",
        "node_clock_clamp",
        f"All {len(sample.gpus)} GPUs of this node are held far below their clocks under load at "
        f"{_when(sample.at)} (GPU {gpu.index}: SM {_show(r.sm_clock_mhz)} of {_show(r.max_sm_clock_mhz)} MHz "
        f"at {_show(r.utilization_gpu_pct)} %, {', '.join(r.throttle_reasons)}): the chassis asserts its "
        "power brake. Drain the node and check its PSUs and power brake signal.",
    )


def _hot(gpu: GpuContext, r: GpuTelemetry, at: dt.datetime, limits: HealthThresholds) -> HealthFinding | None:
    if r.temperature_c is None or r.temperature_c < limits.temperature_warning_c:
        return None
    return HealthFinding(
        "warning",
        "hot",
        f"GPU {gpu.index} is at {r.temperature_c:.0f} °C (temperature.gpu at {_when(at)}, warning at "
        f"{limits.temperature_warning_c:.0f} °C): check the fans and airflow before it throttles.",
    )


def _pcie_narrow(gpu: GpuContext, r: GpuTelemetry, at: dt.datetime) -> HealthFinding | None:
    # Only the width: the link generation drops at idle to save power (normal), the width does not.
    if r.pcie_width is None or r.pcie_width_max is None or r.pcie_width >= r.pcie_width_max:
        return None
    return HealthFinding(
        "warning",
        "pcie_link_narrow",
        f"GPU {gpu.index}'s PCIe link runs at x{r.pcie_width} of its x{r.pcie_width_max} "
        f"(pcie.link.width.current at {_when(at)}): host transfers are slower. Reseat the card or "
        "its riser at the next maintenance.",
    )


def _aggregate_uncorrectable(gpu: GpuContext, r: GpuTelemetry, at: dt.datetime) -> HealthFinding | None:
    if not r.ecc_uncorrected_aggregate or r.ecc_uncorrected_volatile:
        return None
    return HealthFinding(
        "info",
        "ecc_history",
        f"GPU {gpu.index} has had {r.ecc_uncorrected_aggregate} uncorrectable ECC errors in its life "
        f"(ecc.errors.uncorrected.aggregate.total at {_when(at)}), none since its last reset: "
        "watch it; a second-hand card with a history fails again.",
    )


def _recent_xids(gpu: GpuContext, sample: Sample, limits: HealthThresholds) -> list[XidEvent]:
    """This GPU's Xids inside the window, on their own time. An event without a time cannot age:
    it counts (an unplaced Xid 79 must not be lost), and its finding says its time is unknown."""
    window_start = sample.at - dt.timedelta(minutes=limits.xid_window_minutes)
    return [
        x
        for x in sample.xids
        if same_pci_device(x.pci_bus_id, gpu.pci_bus_id)
        and (x.at is None or x.at >= window_start)
        and (gpu.cleared_at is None or (x.at is not None and x.at > gpu.cleared_at))
    ]


def evaluate(gpu: GpuContext, sample: Sample, *, limits: HealthThresholds | None = None) -> GpuVerdict:
    """Judge these readings: the state of one GPU from one sample, and every finding that put it there."""
    limits = limits or HealthThresholds()
    if sample.unavailable:
        return GpuVerdict(gpu.index, HealthState.UNKNOWN)
    xids = _recent_xids(gpu, sample, limits)
    findings: list[HealthFinding | None] = [_no_answer(gpu, sample), _duplicate_row(gpu, sample)]
    reading = next((r for r in sample.gpus if r.index == gpu.index), None)
    throttled_since = None
    if reading is not None:
        throttle, throttled_since = _throttling(gpu, reading, sample.at, limits)
        findings += [
            _driver_says(gpu, reading, sample.at),
            _recovery_action(gpu, reading, sample.at),
            _uncorrectable_ecc(gpu, reading, sample.at),
            _retirement_pending(gpu, reading, sample.at),
            _remapping_failed(gpu, reading, sample.at),
            _node_clock_clamp(gpu, reading, sample),
            throttle,
            _hot(gpu, reading, sample.at, limits),
            _pcie_narrow(gpu, reading, sample.at),
            _aggregate_uncorrectable(gpu, reading, sample.at),
            _unknown_readings(gpu, reading, sample.at),
        ]
    findings += _xid_findings(gpu, xids)
    findings.append(_unsupported_fields(gpu, sample))
    present = tuple(f for f in findings if f is not None)
    state = worst_state(f.level for f in present)
    return GpuVerdict(gpu.index, state, present, throttled_since, reading)


def worst_state(levels: Iterable[str]) -> HealthState:
    state = HealthState.HEALTHY
    for level in levels:
        if level in _SEVERITY and _SEVERITY[HealthState(level)] > _SEVERITY[state]:
            state = HealthState(level)
    return state


def is_sick(state: str) -> bool:
    """Degraded or lost: the GPU takes no new work and its deployments are drained."""
    return state in SICK_STATES
