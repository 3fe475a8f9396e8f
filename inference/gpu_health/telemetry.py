"""`nvidia-smi --query-gpu` health output, read per row and per value.

One unreadable value is unknown for that field, one unreadable row costs only its own GPU, and a
bracketed driver token (`[GPU requires reset]`) is kept as what the driver said about that GPU
(docs/gpu-health.md, "Parse rules"). Nothing here raises for the driver's output: what cannot be
read is reported in `HealthTable.problems`, by line number and column, never by quoting the row.
"""

from __future__ import annotations

import csv
import math
import re
from dataclasses import asdict, dataclass, field, replace
from typing import Any

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


def health_command(fields: tuple[str, ...] = HEALTH_FIELDS) -> list[str]:
    return ["nvidia-smi", "--query-gpu=" + ",".join(fields), "--format=csv,noheader,nounits"]


HEALTH_COMMAND = health_command()

# Readings the driver does not have for this GPU (a PCIe card has no memory temperature): None.
_NOT_APPLICABLE = frozenset({"[N/A]", "[Not Supported]", "N/A", ""})
# Readings the driver could not take: unknown, and said so (nvidia-smi's own error tokens).
_UNREADABLE_TOKENS = frozenset({"ERR!", "[Unknown Error]", "[Insufficient Permissions]", "[Not Found]"})
_GPU_LOST = "[GPU is lost]"
_REQUIRES_RESET = "[GPU requires reset]"
_NO_DEVICES = "No devices were found"

# Beyond these a reading is a driver glitch, not a measurement (6553 °C is 0xFFFF/10; 400 % is a
# counter overflow): the value is unknown. Units are the `nounits` ones.
_BOUNDS: dict[str, tuple[float, float]] = {
    "utilization.gpu": (0, 100),
    "utilization.memory": (0, 100),
    "memory.used": (0, 10_000_000),
    "memory.total": (1, 10_000_000),
    "temperature.gpu": (-40, 150),
    "temperature.memory": (-40, 150),
    "power.draw": (0, 5_000),
    "power.limit": (1, 5_000),
    "clocks.sm": (0, 10_000),
    "clocks.mem": (0, 50_000),
    "clocks.max.sm": (1, 10_000),
}


class TelemetryError(ValueError):
    """nvidia-smi printed something this module cannot read at all (kept for callers that catch it)."""


# clocks_throttle_reasons.active (clocks_event_reasons.active since driver 535) is a bitmask, with the
# bit values of nvml.h's nvmlClocksEventReason* constants.
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
    """One GPU's answer to the health query. None: not applicable ([N/A]) or unknown (`unknown_fields`)."""

    index: int
    uuid: str
    pci_bus_id: str
    name: str
    persistence_mode: bool | None = None
    utilization_gpu_pct: float | None = None
    utilization_memory_pct: float | None = None
    memory_used_mib: float | None = None
    memory_total_mib: float | None = None
    temperature_c: float | None = None
    memory_temperature_c: float | None = None
    power_draw_w: float | None = None
    power_limit_w: float | None = None
    sm_clock_mhz: float | None = None
    memory_clock_mhz: float | None = None
    max_sm_clock_mhz: float | None = None
    throttle_mask: int | None = None
    ecc_corrected_volatile: int | None = None
    ecc_uncorrected_volatile: int | None = None
    ecc_corrected_aggregate: int | None = None
    ecc_uncorrected_aggregate: int | None = None
    retired_pages_single_bit: int | None = None
    retired_pages_double_bit: int | None = None
    retired_pages_pending: bool | None = None
    remapped_rows_correctable: int | None = None
    remapped_rows_uncorrectable: int | None = None
    remapped_rows_pending: bool | None = None
    remapped_rows_failure: bool | None = None
    pcie_gen: int | None = None
    pcie_gen_max: int | None = None
    pcie_width: int | None = None
    pcie_width_max: int | None = None
    mig_enabled: bool | None = None
    # The driver's own verdict (`gpu_recovery_action`, drivers 570+), when the query carried it.
    recovery_action: str | None = None
    # Fields whose value could not be read (an error token, not a number, absurd, non-finite, or
    # hidden by MIG): unknown, never taken as healthy.
    unknown_fields: tuple[str, ...] = ()
    # Bracketed tokens the driver printed about this GPU itself, e.g. "GPU requires reset".
    driver_says: tuple[str, ...] = ()

    @property
    def throttle_reasons(self) -> tuple[str, ...]:
        return throttle_reason_names(self.throttle_mask)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "throttle_reasons": list(self.throttle_reasons)}


@dataclass(frozen=True)
class RowProblem:
    """A line of the output that could not be read as a GPU: `index` when the line still names one."""

    line: int
    index: int | None
    reason: str
    # A bracketed verdict the driver printed in the line all the same ("GPU requires reset").
    says: tuple[str, ...] = ()


@dataclass(frozen=True)
class HealthTable:
    """What one health query's text said: the GPUs read, and the lines that could not be."""

    gpus: tuple[GpuTelemetry, ...] = ()
    problems: tuple[RowProblem, ...] = field(default_factory=tuple)
    # GPUs the driver lists as `[GPU is lost]`: it knows them and cannot reach them.
    lost: tuple[int, ...] = ()


# Driver 580 accepts the old names in the query but prints their current names in a header.
_HEADER_ALIASES = {
    "clocks.current.sm": "clocks.sm",
    "clocks.current.memory": "clocks.mem",
    "clocks_event_reasons.active": "clocks_throttle_reasons.active",
    "clocks.max.streaming_multiprocessor": "clocks.max.sm",
    "clocks.current.streaming_multiprocessor": "clocks.sm",
}
_UNIT_SUFFIX_RE = re.compile(r"\s*\[[^\]]*\]$")
# A number as nvidia-smi prints it, a unit possibly left on ("250.00 W", "87 %").
_NUMBER_RE = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?(\s+\S+)?$")


class _Row:
    """One data row being read: each accessor returns a value or None, and notes what was unreadable."""

    def __init__(self, cells: dict[str, str], mig: bool) -> None:
        self.cells = cells
        self.mig = mig
        self.unknown: list[str] = []

    def _raw(self, column: str) -> str | None:
        value = self.cells.get(column)
        if value is None:
            return None  # the driver lacks the field (dropped from the query): unknown, not listed
        if value in _UNREADABLE_TOKENS or value == _REQUIRES_RESET:
            self.unknown.append(column)
            return None
        if value in _NOT_APPLICABLE:
            # Under MIG the driver hides whole-GPU utilization and row remapping: [N/A] there means
            # "not shown", not "nothing to report".
            if self.mig and column.startswith(("utilization.", "remapped_rows.")):
                self.unknown.append(column)
            return None
        return value

    def number(self, column: str) -> float | None:
        value = self._raw(column)
        if value is None:
            return None
        if not _NUMBER_RE.match(value):  # a decimal comma, ERR-like text, inf, nan
            self.unknown.append(column)
            return None
        number = float(value.split()[0])
        low, high = _BOUNDS.get(column, (0, math.inf))
        if not math.isfinite(number) or not low <= number <= high:
            self.unknown.append(column)
            return None
        return number

    def integer(self, column: str) -> int | None:
        number = self.number(column)
        return None if number is None else int(number)

    def flag(self, column: str) -> bool | None:
        value = self._raw(column)
        if value is None:
            return None
        lowered = value.lower()
        if lowered in {"yes", "enabled", "1"}:
            return True
        if lowered in {"no", "disabled", "0"}:
            return False
        self.unknown.append(column)
        return None

    def mask(self, column: str) -> int | None:
        value = self._raw(column)
        if value is None:
            return None
        try:
            return int(value, 16) if value.lower().startswith("0x") else int(value)
        except ValueError:
            self.unknown.append(column)
            return None


def _header(cells: list[str]) -> list[str] | None:
    """Canonical column names if `cells` is a `--format=csv` header line, else None (a data row).

    A data row never holds the word `index` as a cell, so the header is found wherever `index` sits
    (a wide capture of 200+ fields puts it anywhere)."""
    names = [_HEADER_ALIASES.get(name, name) for name in (_UNIT_SUFFIX_RE.sub("", c) for c in cells)]
    return names if "index" in names else None


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in next(csv.reader([line], skipinitialspace=True), [])]


def read_health_table(text: str, *, fields: tuple[str, ...] = HEALTH_FIELDS) -> HealthTable:
    """Read the health query's output, without a header (`noheader,nounits`: `fields` in order) or
    with one (`--format=csv`: columns by name wherever they sit, units after the numbers)."""
    text = text.lstrip("\ufeff")  # a capture saved by an editor on Windows starts with a UTF-8 BOM
    if not text.strip() or text.strip().startswith(_NO_DEVICES):
        return HealthTable()
    gpus: dict[int, GpuTelemetry] = {}
    problems: list[RowProblem] = []
    lost: list[int] = []
    columns: list[str] | None = None
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue  # nvidia-smi never starts a line with `#`: a note kept with a capture
        cells = _cells(line)
        header = _header(cells)
        if header is not None:
            columns = header  # wherever it comes: a capture may carry notes above it
            continue
        if columns is None:
            columns = list(fields)
        position = columns.index("index") if "index" in columns else None
        raw_index = cells[position] if position is not None and position < len(cells) else ""
        index = int(raw_index) if raw_index.isdigit() else None
        if _GPU_LOST in cells:
            if index is not None:
                lost.append(index)
            continue  # a GPU the driver lists but cannot reach: it did not answer
        says = ("GPU requires reset",) if _REQUIRES_RESET in cells else ()
        if len(cells) != len(columns):
            why = f"line {number} has {len(cells)} values where {len(columns)} were asked for"
            problems.append(RowProblem(number, index, why, says))
            continue
        if index is None:
            why = f"line {number} has no GPU index in column {position}"
            problems.append(RowProblem(number, None, why, says))
            continue
        if index in gpus:
            problems.append(
                RowProblem(number, index, f"line {number} repeats GPU index {index}; the first row is kept")
            )
            continue
        gpus[index] = _telemetry(index, dict(zip(columns, cells, strict=True)))
    return HealthTable(tuple(gpus.values()), tuple(problems), tuple(lost))


def _telemetry(index: int, cells: dict[str, str]) -> GpuTelemetry:
    # Under MIG the driver hides whole-GPU utilization: a GPU that answers but prints [N/A] there is
    # partitioned (or hides it for another reason), and its [N/A] remap readings say nothing either.
    # A wide capture that carries mig.mode.current says so outright.
    mig = cells.get("mig.mode.current", "").lower() == "enabled" or cells.get(
        "utilization.gpu"
    ) in _NOT_APPLICABLE - {""}
    row = _Row(cells, mig)
    said = tuple(
        sorted(
            {c.strip("[]") for c in cells.values() if c in (_REQUIRES_RESET, "[Insufficient Permissions]")}
        )
    )
    telemetry = GpuTelemetry(
        index=index,
        uuid=cells.get("uuid", ""),
        pci_bus_id=cells.get("pci.bus_id", ""),
        name=cells.get("name", ""),
        persistence_mode=row.flag("persistence_mode"),
        utilization_gpu_pct=row.number("utilization.gpu"),
        utilization_memory_pct=row.number("utilization.memory"),
        memory_used_mib=row.number("memory.used"),
        memory_total_mib=row.number("memory.total"),
        temperature_c=row.number("temperature.gpu"),
        memory_temperature_c=row.number("temperature.memory"),
        power_draw_w=row.number("power.draw"),
        power_limit_w=row.number("power.limit"),
        sm_clock_mhz=row.number("clocks.sm"),
        memory_clock_mhz=row.number("clocks.mem"),
        max_sm_clock_mhz=row.number("clocks.max.sm"),
        throttle_mask=row.mask("clocks_throttle_reasons.active"),
        ecc_corrected_volatile=row.integer("ecc.errors.corrected.volatile.total"),
        ecc_uncorrected_volatile=row.integer("ecc.errors.uncorrected.volatile.total"),
        ecc_corrected_aggregate=row.integer("ecc.errors.corrected.aggregate.total"),
        ecc_uncorrected_aggregate=row.integer("ecc.errors.uncorrected.aggregate.total"),
        retired_pages_single_bit=row.integer("retired_pages.single_bit_ecc.count"),
        retired_pages_double_bit=row.integer("retired_pages.double_bit.count"),
        retired_pages_pending=row.flag("retired_pages.pending"),
        remapped_rows_correctable=row.integer("remapped_rows.correctable"),
        remapped_rows_uncorrectable=row.integer("remapped_rows.uncorrectable"),
        remapped_rows_pending=row.flag("remapped_rows.pending"),
        remapped_rows_failure=row.flag("remapped_rows.failure"),
        pcie_gen=row.integer("pcie.link.gen.current"),
        pcie_gen_max=row.integer("pcie.link.gen.max"),
        pcie_width=row.integer("pcie.link.width.current"),
        pcie_width_max=row.integer("pcie.link.width.max"),
        mig_enabled=row.flag("mig.mode.current") if "mig.mode.current" in cells else None,
        recovery_action=cells.get("gpu_recovery_action")
        if cells.get("gpu_recovery_action") not in _NOT_APPLICABLE
        else None,
    )
    unknown = list(row.unknown)
    used, total = telemetry.memory_used_mib, telemetry.memory_total_mib
    if used is not None and total is not None and used > total:
        unknown.append("memory.used")  # more used than there is: the reading, not the card, is wrong
        telemetry = replace(telemetry, memory_used_mib=None)
    return replace(telemetry, unknown_fields=tuple(dict.fromkeys(unknown)), driver_says=said)


def parse_health_csv(text: str, *, fields: tuple[str, ...] = HEALTH_FIELDS) -> list[GpuTelemetry]:
    """The GPUs readable in health-query text (rows that cannot be read are left out: see
    `read_health_table` for them)."""
    return list(read_health_table(text, fields=fields).gpus)
