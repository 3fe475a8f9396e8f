"""What each Xid means for the GPU and what the operator does about it.

Every row cites its source: NVIDIA's Xid catalog (https://docs.nvidia.com/deploy/xid-errors/,
"XID_Errors.pdf" of the r570–r590 drivers: its "Immediate action" column) and, for Xid 154, the
driver's own recovery verdict. The levels are this portal's reading of those actions
(docs/gpu-health.md, "The Xid table"): `healthy` (the application's fault: restart it), `warning`
(the GPU works, watch it), `degraded` (its state is not to be trusted until a reset), `lost` (it
is gone until the node reboots or the card is replaced). The driver's own flags in the line
(`RST: Yes`, `D-RST: Yes`, the 154 recovery action) override the table.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum

CATALOG = "https://docs.nvidia.com/deploy/xid-errors/index.html"


class Action(StrEnum):
    RESTART_APP = "restart the application"
    WATCH = "watch it; run the field diagnostics if it recurs on this GPU"
    RESET_GPU = "drain it and reset the GPU (nvidia-smi -r) or reboot the node"
    DRAIN_NVLINK_PEERS = "drain it and its NVLink peers, then reset the GPUs"
    DRAIN_AND_RESET = "drain every workload from it, then reset the GPU"
    REBOOT_NODE = "drain the node and reboot it"
    REPLACE_CARD = "take it out of service and have the card replaced"


@dataclass(frozen=True)
class XidRule:
    code: int
    name: str
    level: str  # healthy | warning | degraded | lost
    action: Action
    source: str
    memory: bool = False  # a memory-integrity event: all such events are named in one finding


def _row(
    code: int, name: str, level: str, action: Action, *, memory: bool = False, source: str = ""
) -> XidRule:
    return XidRule(code, name, level, action, source or f"{CATALOG} (Xid {code})", memory)


XID_TABLE: dict[int, XidRule] = {
    rule.code: rule
    for rule in (
        _row(13, "graphics engine exception", "healthy", Action.RESTART_APP),
        _row(31, "GPU memory page fault (MMU fault)", "healthy", Action.RESTART_APP),
        _row(32, "invalid or corrupted push buffer stream", "warning", Action.WATCH),
        _row(43, "GPU stopped processing (application fault)", "healthy", Action.RESTART_APP),
        _row(45, "preemptive cleanup after earlier errors", "healthy", Action.RESTART_APP),
        _row(48, "double-bit ECC error", "degraded", Action.RESET_GPU, memory=True),
        _row(61, "internal micro-controller breakpoint/warning", "degraded", Action.RESET_GPU),
        _row(62, "internal micro-controller halt", "degraded", Action.RESET_GPU),
        _row(63, "page retirement or row remapping recorded", "degraded", Action.RESET_GPU, memory=True),
        _row(64, "page retirement or row remapping failure", "degraded", Action.REPLACE_CARD, memory=True),
        _row(68, "video processor (NVDEC) exception", "warning", Action.RESTART_APP),
        _row(69, "graphics engine class error", "warning", Action.RESTART_APP),
        _row(74, "NVLink error", "degraded", Action.DRAIN_NVLINK_PEERS),
        _row(79, "GPU has fallen off the bus", "lost", Action.REBOOT_NODE),
        _row(92, "high single-bit ECC error rate", "warning", Action.WATCH, memory=True),
        _row(94, "contained ECC error", "warning", Action.RESTART_APP, memory=True),
        _row(95, "uncontained ECC error", "degraded", Action.RESET_GPU, memory=True),
        _row(109, "context switch timeout", "warning", Action.RESTART_APP),
        _row(119, "GSP RPC timeout", "degraded", Action.RESET_GPU),
        _row(120, "GSP error", "degraded", Action.RESET_GPU),
        _row(121, "C2C link corrected error", "warning", Action.WATCH),
        _row(140, "unrecovered ECC error", "degraded", Action.RESET_GPU, memory=True),
        _row(143, "GPU initialization failure", "lost", Action.REBOOT_NODE),
        _row(145, "NVLink RLW error (non-fatal)", "warning", Action.WATCH),
        _row(149, "NVLink (NETIR) error", "degraded", Action.DRAIN_NVLINK_PEERS),
        _row(
            154,
            "GPU recovery action changed",
            "degraded",
            Action.RESET_GPU,
            source=f"{CATALOG} (Xid 154 and its recovery actions: GPU Reset Required, Drain and Reset, "
            "Node Reboot Required, PF FLR)",
        ),
    )
}

# Xid 154: "GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)".
_RECOVERY_RE = re.compile(r"to 0x[0-9a-fA-F]+ \((?P<action>[^)]+)\)")
RECOVERY_ACTIONS: dict[str, tuple[str, Action]] = {
    "none": ("healthy", Action.WATCH),
    "gpu reset required": ("degraded", Action.RESET_GPU),
    "pf flr": ("degraded", Action.RESET_GPU),  # a function-level reset of the GPU's PCIe function
    "drain and reset": ("degraded", Action.DRAIN_AND_RESET),
    "node reboot required": ("lost", Action.REBOOT_NODE),
    "os reboot": ("lost", Action.REBOOT_NODE),  # the same verdict, as some 590+ drivers word it
}
_RST_RE = re.compile(r"(?<![-\w])RST: (?P<rst>Yes|No)")
_DRST_RE = re.compile(r"D-RST: (?P<drst>Yes|No)")


@dataclass(frozen=True)
class XidJudgement:
    level: str
    action: Action
    why: str  # what decided the level: the table, or the driver's own words


def judge_xid(code: int, detail: str) -> XidJudgement:
    """The level and action for one Xid line, the driver's flags taking precedence over the table."""
    rule = XID_TABLE.get(code)
    level, action = (rule.level, rule.action) if rule else ("warning", Action.WATCH)
    why = f"Xid {code} ({rule.name})" if rule else f"Xid {code} (not in this portal's table)"
    if code == 154 and (match := _RECOVERY_RE.search(detail)):
        said = match.group("action").strip()
        level, action = RECOVERY_ACTIONS.get(said.lower(), ("degraded", Action.RESET_GPU))
        return XidJudgement(level, action, f"Xid 154: the driver asks for '{said}'")
    drst, rst = _DRST_RE.search(detail), _RST_RE.search(detail)
    if drst and drst.group("drst") == "Yes":
        return XidJudgement("degraded", Action.DRAIN_AND_RESET, f"{why}, driver flag D-RST: Yes")
    if rst and rst.group("rst") == "Yes":
        return XidJudgement(_worse(level, "degraded"), Action.RESET_GPU, f"{why}, driver flag RST: Yes")
    if rst and code == 95:
        # An uncontained error the driver says needs no reset (RST: No): the application died with it.
        return XidJudgement("warning", Action.RESTART_APP, f"{why}, driver flag RST: No")
    return XidJudgement(level, action, why)


_ORDER = ["healthy", "warning", "degraded", "lost"]


def _worse(a: str, b: str) -> str:
    return max(a, b, key=_ORDER.index)
