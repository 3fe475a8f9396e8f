"""Taking one sample on a node: the health query (surviving a driver that lacks a field) and the
kernel log, each bounded in time so a hung driver cannot hold the agent."""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from .kernel_log import XidEvent, parse_kernel_log
from .telemetry import HEALTH_FIELDS, GpuTelemetry, RowProblem, health_command, read_health_table

# dmesg needs no journal; --time-format iso gives absolute times. Where dmesg is restricted
# (kernel.dmesg_restrict) the agent reads nothing.
KERNEL_LOG_COMMAND = ["dmesg", "--time-format", "iso"]

# A sample must not hold the agent: nvidia-smi on a hung driver blocks in the kernel for minutes.
DEFAULT_TIMEOUT_S = 10.0

_DRIVER_DOWN = "NVIDIA-SMI has failed"
# What a driver says of a field it does not know (exit status 2), e.g. the 470 branch of
# compute_cap and drivers before 460 of remapped_rows.*.
_INVALID_FIELD_RE = re.compile(r'Field "(?P<field>[^"]+)" is not a valid field to query')


@dataclass(frozen=True)
class Sample:
    """One sampling pass on a node: the GPUs that answered, or why none did."""

    at: dt.datetime
    gpus: tuple[GpuTelemetry, ...] = ()
    # Set when nvidia-smi itself failed: timed out, driver down, unexpected exit. Every GPU the
    # portal knows and that has no row is then unanswered (a reading in itself: `lost`).
    error: str = ""
    # True when this machine has no nvidia-smi at all: nothing can be said (state `unknown`).
    unavailable: bool = False
    xids: tuple[XidEvent, ...] = ()
    seconds: float = 0.0
    # Lines that could not be read as a GPU: each costs only the GPU it names.
    problems: tuple[RowProblem, ...] = ()
    # GPUs the driver printed as [GPU is lost].
    lost: tuple[int, ...] = ()
    # Fields this driver refused ("is not a valid field to query"), dropped from the query.
    unsupported_fields: tuple[str, ...] = ()


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


def boot_time(path: str = "/proc/stat") -> dt.datetime | None:
    """When this machine booted (the kernel's `btime`), to place dmesg's seconds-since-boot stamps."""
    try:
        with open(path) as stat:
            for line in stat:
                if line.startswith("btime "):
                    return dt.datetime.fromtimestamp(int(line.split()[1]), dt.UTC)
    except (OSError, ValueError):
        return None
    return None


def _why(result: subprocess.CompletedProcess[str]) -> str:
    """The driver's own message for a failed query, never a CSV data row: stderr first, then a
    stdout line that is not a row of values."""
    lines = [x.strip() for x in f"{result.stderr or ''}\n{result.stdout or ''}".splitlines() if x.strip()]
    message = next((x for x in lines if "," not in x or _DRIVER_DOWN in x), "")
    return f"nvidia-smi exited with status {result.returncode}" + (f": {message}" if message else "")


def read_sample(
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    run: Runner = bounded_run,
    read_kernel_log: bool = True,
    now: Callable[[], dt.datetime] | None = None,
    fields: tuple[str, ...] = HEALTH_FIELDS,
    booted_at: Callable[[], dt.datetime | None] = boot_time,
) -> Sample:
    """Run the health query (and read the kernel log) on this machine, never longer than `timeout_s`
    per command. A field the driver does not know is dropped and the query asked again."""
    clock = now or (lambda: dt.datetime.now(dt.UTC))
    began = time.perf_counter()
    at = clock()
    error = ""
    unavailable = False
    unsupported: list[str] = []
    table = None
    while True:
        try:
            result = run(
                health_command(fields), capture_output=True, text=True, timeout=timeout_s, check=False
            )
        except FileNotFoundError:
            unavailable = True
            break
        except subprocess.TimeoutExpired:
            error = f"nvidia-smi did not answer within {timeout_s:g} s"
            break
        except OSError as failure:
            error = f"nvidia-smi could not be run: {failure}"
            break
        output = f"{result.stdout or ''}\n{result.stderr or ''}"
        invalid = _INVALID_FIELD_RE.search(output)
        if result.returncode != 0 and invalid and invalid.group("field") in fields[1:]:
            # Never `index` (fields[0]): without it no row names its GPU.
            unsupported.append(invalid.group("field"))
            fields = tuple(f for f in fields if f != invalid.group("field"))
            continue
        if result.returncode != 0 or _DRIVER_DOWN in output:
            # With one GPU off the bus nvidia-smi still lists the others and exits non-zero: keep
            # their rows; the missing one is then unanswered, with this message as the reason.
            error = _why(result)
        table = read_health_table(result.stdout if _DRIVER_DOWN not in output else "", fields=fields)
        break
    xids: tuple[XidEvent, ...] = ()
    if read_kernel_log and not unavailable:
        xids = tuple(_read_xids(run, timeout_s, boot=booted_at(), now=at))
    return Sample(
        at=at,
        gpus=table.gpus if table else (),
        error=error,
        unavailable=unavailable,
        xids=xids,
        seconds=time.perf_counter() - began,
        problems=table.problems if table else (),
        lost=table.lost if table else (),
        unsupported_fields=tuple(unsupported),
    )


def _read_xids(
    run: Runner, timeout_s: float, *, boot: dt.datetime | None, now: dt.datetime
) -> list[XidEvent]:
    """Xid events where the kernel log is readable; none (not an error) where it is not."""
    try:
        result = run(KERNEL_LOG_COMMAND, capture_output=True, text=True, timeout=timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return []
    if result.returncode != 0:
        return []
    return parse_kernel_log(result.stdout or "", boot_time=boot, now=now)
