"""GPU health: what `nvidia-smi --query-gpu` and the kernel log say about each GPU, and what it means.

Discovery (inference/nvidia_smi.py) reads what a GPU *is*; this package reads how it is *doing*.
The public entry points (docs/gpu-health.md names them for outside checkers):

- parse this text: `read_health_table` / `parse_health_csv` (the health CSV, telemetry.py) and
  `parse_kernel_log` (Xid lines, kernel_log.py);
- judge these readings: `evaluate` (one GPU of one `Sample`, rules.py), `judge_xid` (one Xid line
  against the table in xid.py);
- take a sample on this machine: `read_sample` (sampling.py).
"""

from .cli import main
from .kernel_log import XidEvent, parse_kernel_log, same_pci_device
from .rules import (
    POWER_REASONS,
    SICK_STATES,
    THERMAL_REASONS,
    GpuContext,
    GpuVerdict,
    HealthFinding,
    HealthState,
    HealthThresholds,
    checks_for,
    evaluate,
    is_sick,
    worst_state,
)
from .sampling import (
    DEFAULT_TIMEOUT_S,
    KERNEL_LOG_COMMAND,
    Runner,
    Sample,
    boot_time,
    bounded_run,
    read_sample,
)
from .telemetry import (
    HEALTH_COMMAND,
    HEALTH_FIELDS,
    THROTTLE_REASONS,
    GpuTelemetry,
    HealthTable,
    RowProblem,
    TelemetryError,
    health_command,
    parse_health_csv,
    read_health_table,
    throttle_reason_names,
)
from .xid import XID_TABLE, Action, XidJudgement, XidRule, judge_xid

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "HEALTH_COMMAND",
    "HEALTH_FIELDS",
    "KERNEL_LOG_COMMAND",
    "POWER_REASONS",
    "SICK_STATES",
    "THERMAL_REASONS",
    "THROTTLE_REASONS",
    "XID_TABLE",
    "Action",
    "GpuContext",
    "GpuTelemetry",
    "GpuVerdict",
    "HealthFinding",
    "HealthState",
    "HealthTable",
    "HealthThresholds",
    "RowProblem",
    "Runner",
    "Sample",
    "TelemetryError",
    "XidEvent",
    "XidJudgement",
    "XidRule",
    "boot_time",
    "bounded_run",
    "checks_for",
    "evaluate",
    "health_command",
    "is_sick",
    "judge_xid",
    "main",
    "parse_health_csv",
    "parse_kernel_log",
    "read_health_table",
    "read_sample",
    "same_pci_device",
    "throttle_reason_names",
    "worst_state",
]
