"""GPU health: what `nvidia-smi --query-gpu` and the kernel log say about each GPU, and what it means.

Discovery (inference/nvidia_smi.py) reads what a GPU *is*; this module reads how it is *doing*:
utilization, memory, temperature, power, clocks, throttle reasons, ECC counters, retired pages,
remapped rows, PCIe link and persistence mode, plus the driver's Xid events from the kernel log.
Then `evaluate` turns one sample into findings, in the style of the planner's (inference/rules.py):
one function per finding, each saying which reading, when, and what to do.

States, worst first: `lost` (it does not answer, or fell off the bus), `degraded` (it answers but
its memory is not to be trusted until a reset), `warning` (it works, slower or at risk), `healthy`.
`unknown` is a node whose telemetry cannot be read at all (no nvidia-smi): nothing is concluded.
"""

from __future__ import annotations

import contextlib
import csv
import datetime as dt
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from enum import StrEnum

# The exact field list the agent asks for (the H200 capture in inference/data/nvidia_smi/ used it).
HEALTH_FIELDS = (
    "index",
    "uuid",
    "pci.bus_id",
    "name",
    "persistence_mode",
    "utilization.gpu",
    "utilization.memory",
    "memory.used",
    "memory.total",
    "temperature.gpu",
    "temperature.memory",
    "power.draw",
    "power.limit",
    "clocks.sm",
    "clocks.mem",
    "clocks.max.sm",
    "clocks_throttle_reasons.active",
    "ecc.errors.corrected.volatile.total",
    "ecc.errors.uncorrected.volatile.total",
    "ecc.errors.corrected.aggregate.total",
    "ecc.errors.uncorrected.aggregate.total",
    "retired_pages.single_bit_ecc.count",
    "retired_pages.double_bit.count",
    "retired_pages.pending",
    "remapped_rows.correctable",
    "remapped_rows.uncorrectable",
    "remapped_rows.pending",
    "remapped_rows.failure",
    "pcie.link.gen.current",
    "pcie.link.gen.max",
    "pcie.link.width.current",
    "pcie.link.width.max",
)
HEALTH_COMMAND = [
    "nvidia-smi",
    "--query-gpu=" + ",".join(HEALTH_FIELDS),
    "--format=csv,noheader,nounits",
]
# `dmesg` needs no journal; --time-format iso gives absolute times (seconds-since-boot do not compare
# with the portal's clock). Where dmesg is restricted (kernel.dmesg_restrict) the agent reads nothing.
KERNEL_LOG_COMMAND = ["dmesg", "--time-format", "iso"]

# A sample must not hold the agent: nvidia-smi on a hung driver blocks in the kernel for minutes.
DEFAULT_TIMEOUT_S = 10.0

_MISSING = frozenset({"[N/A]", "[Not Supported]", "N/A", "[Unknown Error]", ""})
_NO_DEVICES = "No devices were found"
_DRIVER_DOWN = "NVIDIA-SMI has failed"
_GPU_LOST = "[GPU is lost]"


class HealthState(StrEnum):
    HEALTHY = "healthy"
    WARNING = "warning"
    DEGRADED = "degraded"
    LOST = "lost"
    UNKNOWN = "unknown"


# Worst first: the state of a GPU is its worst finding's level.
_SEVERITY = {
    HealthState.LOST: 3,
    HealthState.DEGRADED: 2,
    HealthState.WARNING: 1,
    HealthState.HEALTHY: 0,
    HealthState.UNKNOWN: 0,
}
SICK_STATES = frozenset({HealthState.DEGRADED, HealthState.LOST})

# clocks_throttle_reasons.active is a bitmask (nvml's nvmlClocksEventReasons).
THROTTLE_REASONS = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}
THERMAL_REASONS = frozenset({"sw_thermal_slowdown", "hw_thermal_slowdown", "hw_slowdown"})
POWER_REASONS = frozenset({"sw_power_cap", "hw_power_brake_slowdown"})


def throttle_reason_names(mask: int | None) -> tuple[str, ...]:
    """Named reasons of a `clocks_throttle_reasons.active` mask; unknown bits as `bit_0x…`."""
    if not mask:
        return ()
    names = [name for bit, name in THROTTLE_REASONS.items() if mask & bit]
    unknown = mask & ~sum(THROTTLE_REASONS)
    bit = 1
    while unknown:
        if unknown & bit:
            names.append(f"bit_{bit:#x}")
            unknown &= ~bit
        bit <<= 1
    return tuple(names)


@dataclass(frozen=True)
class GpuTelemetry:
    """One GPU's answer to `HEALTH_COMMAND`. None: the driver printed [N/A] or [Not Supported]."""

    index: int
    uuid: str
    pci_bus_id: str
    name: str
    persistence_mode: bool | None
    utilization_gpu_pct: float | None
    utilization_memory_pct: float | None
    memory_used_mib: float | None
    memory_total_mib: float | None
    temperature_c: float | None
    memory_temperature_c: float | None
    power_draw_w: float | None
    power_limit_w: float | None
    sm_clock_mhz: float | None
    memory_clock_mhz: float | None
    max_sm_clock_mhz: float | None
    throttle_mask: int | None
    ecc_corrected_volatile: int | None
    ecc_uncorrected_volatile: int | None
    ecc_corrected_aggregate: int | None
    ecc_uncorrected_aggregate: int | None
    retired_pages_single_bit: int | None
    retired_pages_double_bit: int | None
    retired_pages_pending: bool | None
    remapped_rows_correctable: int | None
    remapped_rows_uncorrectable: int | None
    remapped_rows_pending: bool | None
    remapped_rows_failure: bool | None
    pcie_gen: int | None
    pcie_gen_max: int | None
    pcie_width: int | None
    pcie_width_max: int | None

    @property
    def throttle_reasons(self) -> tuple[str, ...]:
        return throttle_reason_names(self.throttle_mask)

    def to_dict(self) -> dict:
        return {**asdict(self), "throttle_reasons": list(self.throttle_reasons)}


@dataclass(frozen=True)
class XidEvent:
    """One `NVRM: Xid (PCI:…): N, …` line of the kernel log."""

    pci_bus_id: str  # as the driver printed it: 0000:3b:00
    code: int
    detail: str
    at: dt.datetime | None  # None: the line had no absolute time

    def to_dict(self) -> dict:
        return {**asdict(self), "at": self.at.isoformat() if self.at else None}


@dataclass(frozen=True)
class Sample:
    """One sampling pass on a node: the GPUs that answered, or why none did."""

    at: dt.datetime
    gpus: tuple[GpuTelemetry, ...] = ()
    # Set when nvidia-smi itself failed: timed out, driver down, unexpected exit. Every GPU the
    # portal knows is then unanswered (a reading in itself: `lost`).
    error: str = ""
    # True when this machine has no nvidia-smi at all: nothing can be said (state `unknown`).
    unavailable: bool = False
    xids: tuple[XidEvent, ...] = ()
    seconds: float = 0.0


class TelemetryError(ValueError):
    """nvidia-smi printed something this module cannot read."""


def _number(value: str, column: str, line: int) -> float | None:
    if value in _MISSING:
        return None
    try:
        return float(value.split()[0])  # tolerant of a unit left on ("250.00 W")
    except (ValueError, IndexError):
        raise TelemetryError(f"line {line}: {column} {value!r} is not a number") from None


def _integer(value: str, column: str, line: int) -> int | None:
    number = _number(value, column, line)
    return None if number is None else int(number)


def _flag(value: str, column: str, line: int) -> bool | None:
    if value in _MISSING:
        return None
    lowered = value.lower()
    if lowered in {"yes", "enabled", "1"}:
        return True
    if lowered in {"no", "disabled", "0"}:
        return False
    raise TelemetryError(f"line {line}: {column} {value!r} is not yes/no")


def _mask(value: str, column: str, line: int) -> int | None:
    if value in _MISSING:
        return None
    try:
        return int(value, 16) if value.lower().startswith("0x") else int(value)
    except ValueError:
        raise TelemetryError(f"line {line}: {column} {value!r} is not a bitmask") from None


# Driver 580 accepts the old names in the query but prints their current names in a header.
_HEADER_ALIASES = {
    "clocks.current.sm": "clocks.sm",
    "clocks.current.memory": "clocks.mem",
    "clocks_event_reasons.active": "clocks_throttle_reasons.active",
}
_UNIT_SUFFIX_RE = re.compile(r"\s*\[[^\]]*\]$")


def _header(cells: list[str], number: int) -> list[str] | None:
    """Canonical column names if `cells` is a `--format=csv` header line, else None (a data row)."""
    names = [_HEADER_ALIASES.get(name, name) for name in (_UNIT_SUFFIX_RE.sub("", c) for c in cells)]
    if names[:1] != ["index"]:
        return None
    missing = [name for name in HEALTH_FIELDS if name not in names]
    if missing:
        raise TelemetryError(f"line {number}: header lacks {', '.join(missing)}")
    return names


def parse_health_csv(text: str) -> list[GpuTelemetry]:
    """Parse `HEALTH_COMMAND` output: without a header (the agent's `noheader,nounits`, `HEALTH_FIELDS` in
    order) or with one (`--format=csv`: columns by name, units after the numbers)."""
    if not text.strip() or text.strip().startswith(_NO_DEVICES):
        return []
    gpus: list[GpuTelemetry] = []
    columns: list[str] | None = None
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        cells = [cell.strip() for cell in next(csv.reader([line], skipinitialspace=True))]
        if columns is None:
            columns = _header(cells, number)
            if columns is not None:
                continue
            columns = list(HEALTH_FIELDS)
        if _GPU_LOST in cells:
            continue  # a GPU the driver lists but cannot reach: it did not answer
        if len(cells) != len(columns):
            raise TelemetryError(f"line {number}: expected {len(columns)} values, found {len(cells)}")
        row = dict(zip(columns, cells, strict=True))
        if not row["index"].isdigit():
            raise TelemetryError(f"line {number}: index {row['index']!r} is not a number")

        def n(column: str, row: dict = row, number: int = number) -> float | None:
            return _number(row[column], column, number)

        def i(column: str, row: dict = row, number: int = number) -> int | None:
            return _integer(row[column], column, number)

        def f(column: str, row: dict = row, number: int = number) -> bool | None:
            return _flag(row[column], column, number)

        gpus.append(
            GpuTelemetry(
                index=int(row["index"]),
                uuid=row["uuid"],
                pci_bus_id=row["pci.bus_id"],
                name=row["name"],
                persistence_mode=f("persistence_mode"),
                utilization_gpu_pct=n("utilization.gpu"),
                utilization_memory_pct=n("utilization.memory"),
                memory_used_mib=n("memory.used"),
                memory_total_mib=n("memory.total"),
                temperature_c=n("temperature.gpu"),
                memory_temperature_c=n("temperature.memory"),
                power_draw_w=n("power.draw"),
                power_limit_w=n("power.limit"),
                sm_clock_mhz=n("clocks.sm"),
                memory_clock_mhz=n("clocks.mem"),
                max_sm_clock_mhz=n("clocks.max.sm"),
                throttle_mask=_mask(row["clocks_throttle_reasons.active"], "throttle reasons", number),
                ecc_corrected_volatile=i("ecc.errors.corrected.volatile.total"),
                ecc_uncorrected_volatile=i("ecc.errors.uncorrected.volatile.total"),
                ecc_corrected_aggregate=i("ecc.errors.corrected.aggregate.total"),
                ecc_uncorrected_aggregate=i("ecc.errors.uncorrected.aggregate.total"),
                retired_pages_single_bit=i("retired_pages.single_bit_ecc.count"),
                retired_pages_double_bit=i("retired_pages.double_bit.count"),
                retired_pages_pending=f("retired_pages.pending"),
                remapped_rows_correctable=i("remapped_rows.correctable"),
                remapped_rows_uncorrectable=i("remapped_rows.uncorrectable"),
                remapped_rows_pending=f("remapped_rows.pending"),
                remapped_rows_failure=f("remapped_rows.failure"),
                pcie_gen=i("pcie.link.gen.current"),
                pcie_gen_max=i("pcie.link.gen.max"),
                pcie_width=i("pcie.link.width.current"),
                pcie_width_max=i("pcie.link.width.max"),
            )
        )
    return gpus


# `[  123.456789]` (seconds since boot) or `2026-12-02T03:14:15,123456+00:00` (dmesg --time-format iso).
_XID_RE = re.compile(r"NVRM: Xid \(PCI:(?P<bus>[0-9A-Fa-f:.]+)\): (?P<code>\d+),\s*(?P<detail>.*)$")
_ISO_RE = re.compile(r"^(?P<at>\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:[,.]\d+)?(?P<tz>[+-]\d\d:?\d\d|Z)?")


def parse_kernel_log(text: str) -> list[XidEvent]:
    """Xid events in kernel-log text (dmesg, `journalctl -k`); other lines are ignored."""
    events: list[XidEvent] = []
    for line in text.splitlines():
        match = _XID_RE.search(line)
        if match is None:
            continue
        at = None
        stamp = _ISO_RE.match(line.strip())
        if stamp is not None:
            tz = stamp.group("tz") or "+00:00"
            tz = "+00:00" if tz == "Z" else tz
            if ":" not in tz:
                tz = f"{tz[:3]}:{tz[3:]}"
            at = dt.datetime.fromisoformat(stamp.group("at") + tz)
        events.append(
            XidEvent(
                pci_bus_id=match.group("bus").lower(),
                code=int(match.group("code")),
                detail=match.group("detail").strip(),
                at=at,
            )
        )
    return events


def same_pci_device(a: str, b: str) -> bool:
    """Whether two PCI addresses name one device: nvidia-smi prints 00000000:3B:00.0, the kernel
    log 0000:3b:00 (no function, a shorter domain)."""
    return _pci_key(a) == _pci_key(b) is not None


def _pci_key(address: str) -> tuple[int, int, int] | None:
    parts = address.strip().lower().split(":")
    if len(parts) < 3:
        return None
    try:
        return int(parts[0], 16), int(parts[1], 16), int(parts[2].split(".")[0], 16)
    except ValueError:
        return None


Runner = Callable[..., subprocess.CompletedProcess[str]]


def bounded_run(
    argv: list[str], *, timeout: float, capture_output: bool = True, text: bool = True, check: bool = False
) -> subprocess.CompletedProcess[str]:
    """`subprocess.run` that returns within about `timeout` + 1 s even when the child cannot die.

    `subprocess.run` kills a child that timed out and then waits for it without a limit; nvidia-smi
    stuck in the kernel on a hung driver ignores SIGKILL until the driver answers, so that wait would
    hang the agent. Here the child (in its own session) is killed, given a second, then left to a
    daemon thread that reaps it if it ever exits."""
    process = subprocess.Popen(  # noqa: S603 (this module's own fixed commands)
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=text, start_new_session=True
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
        try:
            process.communicate(timeout=1)
        except subprocess.TimeoutExpired:
            threading.Thread(target=process.wait, name="reap-stuck-nvidia-smi", daemon=True).start()
        raise subprocess.TimeoutExpired(argv, timeout) from None
    return subprocess.CompletedProcess(argv, process.returncode, stdout, stderr)


def read_sample(
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    run: Runner = bounded_run,
    read_kernel_log: bool = True,
    now: Callable[[], dt.datetime] | None = None,
) -> Sample:
    """Run `HEALTH_COMMAND` (and the kernel log) on this machine, never for longer than `timeout_s` each."""
    clock = now or (lambda: dt.datetime.now(dt.UTC))
    began = time.perf_counter()
    at = clock()
    gpus: tuple[GpuTelemetry, ...] = ()
    error = ""
    unavailable = False
    try:
        result = run(HEALTH_COMMAND, capture_output=True, text=True, timeout=timeout_s, check=False)
    except FileNotFoundError:
        unavailable = True
    except subprocess.TimeoutExpired:
        error = f"nvidia-smi did not answer within {timeout_s:g} s"
    except OSError as failure:
        error = f"nvidia-smi could not be run: {failure}"
    else:
        output = f"{result.stdout or ''}\n{result.stderr or ''}"
        if result.returncode != 0 or _DRIVER_DOWN in output:
            # With one GPU off the bus nvidia-smi still lists the others and exits non-zero: keep
            # their rows; the missing one is then unanswered, with this message as the reason.
            first = next((x.strip() for x in output.splitlines() if x.strip()), "no output")
            error = f"nvidia-smi exited with status {result.returncode}: {first}"
        try:
            gpus = tuple(parse_health_csv(result.stdout if _DRIVER_DOWN not in output else ""))
        except TelemetryError as failure:
            error = error or f"nvidia-smi printed what cannot be read: {failure}"
    xids: tuple[XidEvent, ...] = ()
    if read_kernel_log and not unavailable:
        xids = tuple(_read_xids(run, timeout_s))
    return Sample(
        at=at,
        gpus=gpus,
        error=error,
        unavailable=unavailable,
        xids=xids,
        seconds=time.perf_counter() - began,
    )


def _read_xids(run: Runner, timeout_s: float) -> list[XidEvent]:
    """Xid events where the kernel log is readable; none (not an error) where it is not."""
    try:
        result = run(KERNEL_LOG_COMMAND, capture_output=True, text=True, timeout=timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return []
    if result.returncode != 0:
        return []
    return parse_kernel_log(result.stdout or "")


# --- Rules -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HealthThresholds:
    """The settings the rules read (portal settings GPU_HEALTH_*; README's settings table)."""

    throttle_minutes: float = 5.0  # thermal or power throttling this long in a row: warning
    temperature_warning_c: float = 85.0  # GPU core at or above this: warning
    xid_window_minutes: float = 60.0  # Xid events older than this are history, not a reading


@dataclass(frozen=True)
class HealthFinding:
    """One thing wrong with a GPU: `level` is the state it puts the GPU in."""

    level: str  # "lost" | "degraded" | "warning" | "info"
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
    why = sample.error or f"nvidia-smi listed {len(sample.gpus)} GPUs but not GPU {gpu.index}"
    return HealthFinding(
        "lost",
        "no_answer",
        f"GPU {gpu.index} did not answer at {_when(sample.at)}: {why}. It has fallen off the bus or "
        "the driver is hung; stop its work and reboot the node (a GPU reset rarely brings it back).",
    )


def _fell_off_bus(gpu: GpuContext, xids: list[XidEvent]) -> HealthFinding | None:
    lost = [x for x in xids if x.code == 79]
    if not lost:
        return None
    event = lost[-1]
    at = _when(event.at) if event.at else "an unknown time"
    return HealthFinding(
        "lost",
        "xid_79",
        f"GPU {gpu.index} fell off the bus (Xid 79 at {at}: {event.detail}). Drain it and reboot the "
        "node; if it recurs, reseat or replace the card (power, riser, overheating).",
    )


# Xids that mean memory can no longer be trusted until the GPU is reset: double-bit ECC (48), page
# retirement / row remapping events (63, 64), high single-bit rate (92), contained / uncontained
# ECC (94, 95).
_MEMORY_XIDS = {
    48: "double-bit ECC error",
    63: "page retirement or row remapping",
    64: "page retirement or row remapping failure",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
}


def _memory_xid(gpu: GpuContext, xids: list[XidEvent]) -> HealthFinding | None:
    memory = [x for x in xids if x.code in _MEMORY_XIDS]
    if not memory:
        return None
    event = memory[-1]
    at = _when(event.at) if event.at else "an unknown time"
    return HealthFinding(
        "degraded",
        f"xid_{event.code}",
        f"GPU {gpu.index} logged Xid {event.code} ({_MEMORY_XIDS[event.code]}) at {at}. Drain it and "
        "reset the GPU (nvidia-smi -r) or reboot the node, then mark it healthy.",
    )


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


def _throttling(
    gpu: GpuContext, r: GpuTelemetry, at: dt.datetime, limits: HealthThresholds
) -> tuple[HealthFinding | None, dt.datetime | None]:
    """Thermal or power throttling: a finding once it lasted `throttle_minutes`; returns the onset."""
    reasons = set(r.throttle_reasons)
    thermal, power = sorted(reasons & THERMAL_REASONS), sorted(reasons & POWER_REASONS)
    if not thermal and not power:
        return None, None
    since = gpu.throttled_since or at
    minutes = (at - since).total_seconds() / 60
    if minutes < limits.throttle_minutes:
        return None, since
    kind = "thermal" if thermal else "power"
    names = ", ".join(thermal or power)
    fix = (
        "check the fans, airflow and inlet temperature of the rack"
        if thermal
        else "check the PSU and the power limit (nvidia-smi -q -d POWER); a capped card runs slower"
    )
    return (
        HealthFinding(
            "warning",
            f"{kind}_throttling",
            f"GPU {gpu.index} has been throttled ({names}) for {minutes:.0f} min, since {_when(since)} "
            f"(temperature {r.temperature_c if r.temperature_c is not None else '?'} °C, power "
            f"{r.power_draw_w if r.power_draw_w is not None else '?'} W of "
            f"{r.power_limit_w if r.power_limit_w is not None else '?'} W): {fix}.",
        ),
        since,
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


def evaluate(gpu: GpuContext, sample: Sample, *, limits: HealthThresholds | None = None) -> GpuVerdict:
    """The state of one GPU from one sample, and every finding that put it there."""
    limits = limits or HealthThresholds()
    if sample.unavailable:
        return GpuVerdict(gpu.index, HealthState.UNKNOWN)
    window_start = sample.at - dt.timedelta(minutes=limits.xid_window_minutes)
    xids = [
        x
        for x in sample.xids
        if same_pci_device(x.pci_bus_id, gpu.pci_bus_id)
        and (x.at is None or x.at >= window_start)
        and (gpu.cleared_at is None or (x.at is not None and x.at > gpu.cleared_at))
    ]
    findings: list[HealthFinding | None] = [_no_answer(gpu, sample), _fell_off_bus(gpu, xids)]
    reading = next((r for r in sample.gpus if r.index == gpu.index), None)
    throttled_since = None
    if reading is not None:
        throttle, throttled_since = _throttling(gpu, reading, sample.at, limits)
        findings += [
            _uncorrectable_ecc(gpu, reading, sample.at),
            _retirement_pending(gpu, reading, sample.at),
            _remapping_failed(gpu, reading, sample.at),
            throttle,
            _hot(gpu, reading, sample.at, limits),
            _pcie_narrow(gpu, reading, sample.at),
            _aggregate_uncorrectable(gpu, reading, sample.at),
        ]
    findings.append(_memory_xid(gpu, xids))
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


def main(argv: list[str] | None = None) -> int:
    """`python -m inference.gpu_health`: one sample of this machine as the agent takes it, judged, as JSON
    (`--raw FILE` also keeps nvidia-smi's own output, e.g. for a committed fixture)."""
    import argparse
    import json

    parser = argparse.ArgumentParser(description=main.__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S)
    parser.add_argument("--raw", help="write nvidia-smi's stdout here")
    args = parser.parse_args(argv)
    if not 0 < args.timeout <= 600:
        parser.error("--timeout must be above 0 and at most 600 s")
    raw: dict[str, str] = {}

    def run(argv: list[str], **kwargs) -> subprocess.CompletedProcess[str]:
        result = bounded_run(argv, **kwargs)
        raw.setdefault(argv[0], result.stdout or "")
        return result

    sample = read_sample(timeout_s=args.timeout, run=run)
    if args.raw:
        with open(args.raw, "w") as out:
            out.write(raw.get("nvidia-smi", ""))
    verdicts = [evaluate(GpuContext(g.index, g.pci_bus_id), sample) for g in sample.gpus]
    report = {
        "at": sample.at.isoformat(),
        "seconds": round(sample.seconds, 4),
        "error": sample.error,
        "unavailable": sample.unavailable,
        "gpus": [g.to_dict() for g in sample.gpus],
        "xids": [x.to_dict() for x in sample.xids],
        "verdicts": [{"index": v.index, "state": v.state, "findings": v.findings_dicts()} for v in verdicts],
    }
    print(json.dumps(report, indent=2))
    return 0 if not sample.error else 1


if __name__ == "__main__":
    raise SystemExit(main())
