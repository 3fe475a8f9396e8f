"""Where one request's time goes in this process, step by step (perf/gateway_overhead.py reads it).

Off unless PORTAL_GATEWAY_STEP_TIMING names a file: then every gateway request records
the time of each step of its path (ASGI entry, authentication, parsing, route, counting,
admission, upstream connect, first byte, per-chunk relay, accounting), as wall-clock time
and as the CPU time of the event loop's thread (which leaves out waiting on Redis or
upstream, and time the process was not scheduled on a busy machine; not per chunk, where
reading that clock, a system call, would cost more than the relay), and the process
writes the medians, in microseconds, to that file about once a second and at exit.
Off, each step costs one module-attribute check (`if timing.ON:`), nothing else.

The steps are laps: each `lap(step)` counts the time since the previous lap (or since
`begin`) toward `step`. A streamed chunk's relay is the time from its arrival from
upstream to the relay being asked for the next one: the SSE relay's own work plus
Django and uvicorn sending it on.
"""

from __future__ import annotations

import atexit
import json
import os
import statistics
import time
from contextvars import ContextVar
from pathlib import Path

FILE = os.environ.get("PORTAL_GATEWAY_STEP_TIMING", "")
ON = bool(FILE)
MAX_SAMPLES = 100_000  # per step, per process: a long run keeps its first samples
WRITE_EVERY_S = 1.0

_now = time.perf_counter_ns
_cpu = time.thread_time_ns


class Steps:
    """One request's laps (ns), and its relay's per-chunk times."""

    __slots__ = ("chunk_in", "chunk_out", "chunks", "laps", "last", "last_cpu", "relay_ns")

    def __init__(self) -> None:
        self.last, self.last_cpu = _now(), _cpu()
        self.laps: dict[str, list[int]] = {}  # step → [wall ns, CPU ns]
        self.chunk_in = self.chunk_out = 0  # wall ns
        self.relay_ns = 0  # wall only: a CPU clock read is a system call, dearer than a chunk's work
        self.chunks = 0


_current: ContextVar[Steps | None] = ContextVar("gateway_steps", default=None)
_samples: dict[str, list[tuple[float, float | None]]] = {}
_written = 0.0


def begin() -> None:
    """A request reached the ASGI application: its steps start now."""
    _current.set(Steps())


def lap(step: str) -> None:
    """The time since the previous lap belongs to `step`."""
    steps = _current.get()
    if steps is not None:
        now, cpu = _now(), _cpu()
        spent = steps.laps.setdefault(step, [0, 0])
        spent[0] += now - steps.last
        spent[1] += cpu - steps.last_cpu
        steps.last, steps.last_cpu = now, cpu


def skip() -> None:
    """Start the next lap now (what passed since the last one belongs to no step)."""
    steps = _current.get()
    if steps is not None:
        steps.last, steps.last_cpu = _now(), _cpu()


def relay_asked() -> None:
    """The relay is asked for its next chunk: the previous one has been sent on."""
    steps = _current.get()
    if steps is not None and steps.chunk_out:
        steps.relay_ns += _now() - steps.chunk_out
        steps.chunk_out = 0


def chunk_arrived() -> None:
    steps = _current.get()
    if steps is not None:
        steps.chunk_in = _now()


def chunk_relayed() -> None:
    steps = _current.get()
    if steps is not None and steps.chunk_in:
        steps.chunk_out = _now()
        steps.relay_ns += steps.chunk_out - steps.chunk_in
        steps.chunk_in = 0
        steps.chunks += 1


def done() -> None:
    """The request has finished: keep its steps, and write the medians now and then."""
    steps = _current.get()
    if steps is None:
        return
    _current.set(None)
    for step, (wall, cpu) in steps.laps.items():
        _keep(step, wall / 1000, cpu / 1000)
    if steps.chunks:
        _keep("per-chunk relay", steps.relay_ns / steps.chunks / 1000, None)
    global _written
    if time.monotonic() - _written >= WRITE_EVERY_S:
        _written = time.monotonic()
        write()


def _keep(step: str, wall_us: float, cpu_us: float | None) -> None:
    samples = _samples.setdefault(step, [])
    if len(samples) < MAX_SAMPLES:
        samples.append((wall_us, cpu_us))


def write() -> None:
    """{step: {"median_us", "median_cpu_us", "samples"}} to the file, replaced whole."""
    summary = {
        step: {
            "median_us": statistics.median(wall for wall, _ in samples),
            "median_cpu_us": statistics.median(cpu for _, cpu in samples if cpu is not None)
            if samples[0][1] is not None
            else None,
            "samples": len(samples),
        }
        for step, samples in _samples.items()
        if samples
    }
    path = Path(FILE)
    partial = path.with_name(path.name + f".{os.getpid()}.tmp")
    partial.write_text(json.dumps(summary, indent=1) + "\n")
    partial.replace(path)


if ON:
    atexit.register(write)
