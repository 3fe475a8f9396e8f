"""Xid events in kernel-log text: dmesg (ISO, `-T` or seconds-since-boot stamps) and the journal.

The driver prints `NVRM: Xid (PCI:0000:3b:00): 79, …`; on a MIG GPU the parenthesis also names the
GPU instance (`PCI:0000:01:00 GPU-I:05`, and `GPU-CI:…`), and drivers before about 2015 printed no
`PCI:` (`NVRM: Xid (0000:03:00): 14, …`). A stamp without an absolute time is placed with the boot
time the agent knows; one without a year (the journal) with the year of `now`.
"""

from __future__ import annotations

import datetime as dt
import re
from dataclasses import asdict, dataclass
from typing import Any

_XID_RE = re.compile(
    r"NVRM: Xid \((?:PCI:)?(?P<bus>[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2})(?:\.[0-7])?"
    r"(?P<mig>[^)]*)\): (?P<code>\d+),?\s*(?P<detail>.*)$"
)
_GPU_INSTANCE_RE = re.compile(r"GPU-I:(\d+)")
# 2026-12-02T03:14:15,123456+00:00 (dmesg --time-format iso)
_ISO_RE = re.compile(r"^(?P<at>\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:[,.]\d+)?(?P<tz>[+-]\d\d:?\d\d|Z)?")
# [Fri Aug 30 11:43:09 2024] (dmesg -T / --ctime: the host's local time)
_CTIME_RE = re.compile(r"^\[(?P<at>[A-Z][a-z]{2} [A-Z][a-z]{2} +\d{1,2} \d\d:\d\d:\d\d \d{4})\]")
# Apr 29 19:24:11 host kernel: (journalctl -k, syslog: local time, no year)
_JOURNAL_RE = re.compile(r"^(?P<at>[A-Z][a-z]{2} +\d{1,2} \d\d:\d\d:\d\d) \S+ kernel:")
# host: kern: warning: [2026-04-22T21:30:51.870495804Z]: (Talos and other forwarders: ISO inside brackets)
_BRACKETED_ISO_RE = re.compile(
    r"\[(?P<at>\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.\d+)?(?P<tz>Z|[+-]\d\d:?\d\d)?\]"
)
# [183911.004512] (plain dmesg: seconds since boot)
_UPTIME_RE = re.compile(r"^\[\s*(?P<seconds>\d+\.\d+)\]")


@dataclass(frozen=True)
class XidEvent:
    """One `NVRM: Xid (…): N, …` line of the kernel log."""

    pci_bus_id: str  # as the driver printed it: 0000:3b:00
    code: int
    detail: str
    at: dt.datetime | None  # None: the line had no time this module could place
    gpu_instance: int | None = None  # the MIG GPU instance the driver attributed it to

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "at": self.at.isoformat() if self.at else None}


def _stamp(
    line: str, *, boot_time: dt.datetime | None, now: dt.datetime | None, tz: dt.tzinfo
) -> dt.datetime | None:
    if match := _ISO_RE.match(line):
        zone = match.group("tz") or "+00:00"
        zone = "+00:00" if zone == "Z" else zone
        if ":" not in zone:
            zone = f"{zone[:3]}:{zone[3:]}"
        return dt.datetime.fromisoformat(match.group("at") + zone)
    if match := _CTIME_RE.match(line):
        text = " ".join(match.group("at").split())
        return dt.datetime.strptime(text, "%a %b %d %H:%M:%S %Y").replace(tzinfo=tz)
    if match := _JOURNAL_RE.match(line):
        year = (now or dt.datetime.now(dt.UTC)).year
        text = " ".join(match.group("at").split())
        at = dt.datetime.strptime(f"{year} {text}", "%Y %b %d %H:%M:%S").replace(tzinfo=tz)
        if now is not None and at > now + dt.timedelta(days=1):
            at = at.replace(year=year - 1)  # December's lines read in January
        return at
    if match := _BRACKETED_ISO_RE.search(line.split("NVRM:", 1)[0]):
        zone = match.group("tz") or "Z"
        return dt.datetime.fromisoformat(match.group("at") + ("+00:00" if zone == "Z" else zone))
    if (match := _UPTIME_RE.match(line)) and boot_time is not None:
        return boot_time + dt.timedelta(seconds=float(match.group("seconds")))
    return None


def parse_kernel_log(
    text: str,
    *,
    boot_time: dt.datetime | None = None,
    now: dt.datetime | None = None,
    tz: dt.tzinfo = dt.UTC,
) -> list[XidEvent]:
    """Xid events in kernel-log text (dmesg in any of its stamp formats, `journalctl -k`); other
    lines are ignored. `boot_time` places `[secs]` stamps; `tz` is the zone of local-time stamps
    (`dmesg -T`, the journal); `now` supplies the journal's missing year."""
    events: list[XidEvent] = []
    for line in text.splitlines():
        match = _XID_RE.search(line)
        if match is None or line.startswith("#"):
            continue
        instance = _GPU_INSTANCE_RE.search(match.group("mig"))
        events.append(
            XidEvent(
                pci_bus_id=match.group("bus").lower(),
                code=int(match.group("code")),
                detail=match.group("detail").strip().rstrip('"'),  # a line quoted in source or a doc
                at=_stamp(line.strip(), boot_time=boot_time, now=now, tz=tz),
                gpu_instance=int(instance.group(1)) if instance else None,
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
