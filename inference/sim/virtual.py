"""The virtual-clock mode: a closed-loop concurrency sweep as a discrete-event simulation.

The same `SimEngine` (scheduler, KV cache, step costs) as the server, on a
clock that jumps from one step's end to the next: nothing sleeps, so a sweep
that would take the GPUs an hour takes seconds. Each of `concurrency` users
sends its next request the moment its last one ends, as the benchmark's closed
loop does; tokens are timestamped at the end of the step that sampled them,
which is when the server would stream them. The records are the benchmark's
`RequestRecord`s, summarised by the benchmark's own `summarize_level`.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

from inference.errors import InputError
from inference.loadgen.sla import Sla, operating_point
from inference.loadgen.summary import RequestRecord, summarize_level
from inference.loadgen.workloads import Mix, RequestSpec, fit_to_context
from inference.sim.engine import EngineConfig, SimEngine
from inference.sim.scheduler import SimRequest

_MAX_REQUESTS_PER_LEVEL = 100_000


class OutOfTime(InputError):
    """The sweep passed its deadline; `levels` holds the levels it finished before."""

    def __init__(self, *, concurrency: int, levels: list[dict[str, Any]]) -> None:
        self.concurrency = concurrency
        self.levels = levels
        super().__init__("concurrency", f"out of time during level {concurrency}")


def prompt_block_hashes(spec: RequestSpec, request_index: int, block_size: int) -> list[int]:
    """Block hashes of a synthetic prompt: a prefix group's shared tokens hash the same for
    every member, the rest is unique to the request, so only shared prefixes hit the cache."""
    shared = min(spec.shared_prefix_tokens, spec.prompt_tokens) if spec.prefix_group is not None else 0
    hashes: list[int] = []
    parent = 0
    for index in range(spec.prompt_tokens // block_size):
        if (index + 1) * block_size <= shared:
            parent = hash((parent, "group", spec.prefix_group, index))
        else:
            parent = hash((parent, "request", request_index, index))
        hashes.append(parent)
    return hashes


@dataclass
class LevelResult:
    level: dict[str, Any]
    records: list[RequestRecord]


def run_level(
    config: EngineConfig,
    specs: Sequence[RequestSpec],
    *,
    concurrency: int,
    warmup: int = 0,
    deadline: float | None = None,
) -> LevelResult:
    """Run `specs` through a fresh engine with `concurrency` closed-loop users.

    The first `warmup` requests (one per user at most is typical) are sent but left
    out of the statistics, as the benchmark leaves its warm-up out. Past `deadline`
    (`time.monotonic()`) it raises OutOfTime: a caller on a web request has a budget.
    """
    if concurrency < 1:
        raise InputError("concurrency", f"must be at least 1, got {concurrency}")
    engine = SimEngine(config)
    # The API server's per-request work delays each request's arrival at the scheduler.
    api_delay = config.host.api_s_per_request
    # Its serial part is served one request at a time: requests sent together queue for it.
    api_serial = config.host.api_serial_s_per_request
    front_end_free = 0.0
    arrivals: list[tuple[float, int, SimRequest]] = []  # (reaches the engine at, order, request)
    now = 0.0
    records: list[RequestRecord | None] = [None] * len(specs)
    next_spec = 0
    # Users' next send times: (time, sequence) so equal times keep their order.
    sends: list[tuple[float, int]] = [(0.0, user) for user in range(min(concurrency, len(specs)))]
    heapq.heapify(sends)
    order = len(sends)

    def send(at: float) -> None:
        nonlocal next_spec, order, front_end_free
        index = next_spec
        next_spec += 1
        spec = specs[index]
        record = RequestRecord(start=at, prompt_tokens=spec.prompt_tokens)
        records[index] = record
        refusal = engine.validate_request(spec.prompt_tokens, spec.output_tokens)
        if refusal is not None:
            # vLLM answers 400 at once; the user moves on to its next request.
            record.error = f"HTTP 400: {refusal}"
            record.end = at
            if next_spec < len(specs):
                heapq.heappush(sends, (at, order))
                order += 1
            return
        request = SimRequest(
            request_id=str(index),
            prompt_token_ids=None,
            num_prompt_tokens=spec.prompt_tokens,
            block_hashes=prompt_block_hashes(spec, index, engine.block_size),
            max_tokens=spec.output_tokens,
            arrival_time=at,
            context=record,
        )
        if api_serial > 0:
            front_end_free = max(at, front_end_free) + api_serial
            heapq.heappush(arrivals, (front_end_free + api_delay, index, request))
        elif api_delay > 0:
            heapq.heappush(arrivals, (at + api_delay, index, request))
        else:
            engine.add(request)

    preemptions_at_start = 0
    while True:
        if deadline is not None and time.monotonic() > deadline:
            raise OutOfTime(concurrency=concurrency, levels=[])
        while sends and sends[0][0] <= now and next_spec < len(specs):
            heapq.heappop(sends)
            send(now)
        while arrivals and arrivals[0][0] <= now:
            engine.add(heapq.heappop(arrivals)[2])
        if not engine.has_work:
            upcoming = [arrivals[0][0]] if arrivals else []
            if sends and next_spec < len(specs):
                upcoming.append(sends[0][0])
            if not upcoming:
                break
            now = max(now, min(upcoming))
            continue
        plan = engine.schedule()
        step = engine.step_time(plan)
        duration = step.total_s
        if duration <= 0:  # nothing schedulable yet cannot happen with work queued; guard anyway
            raise RuntimeError("the scheduler made no progress")
        now += duration
        # A step's tokens reach the API server once the CPU has launched the next step
        # (docs/simulator.md, "The output lag"): only a host-bound step delays them.
        delivered = now + step.output_lag_s
        outcome = engine.finish(plan)
        for request in outcome.sampled:
            cast(RequestRecord, request.context).token_times.append(delivered)
        for request in outcome.finished:
            record = cast(RequestRecord, request.context)
            record.output_tokens = request.num_output_tokens
            record.end = delivered
            if next_spec < len(specs):
                heapq.heappush(sends, (delivered, order))
                order += 1
    done = [r for r in records if r is not None]
    measured = done[warmup:]
    level = summarize_level(measured, concurrency=concurrency, warmup=done[:warmup])
    level["preemptions"] = engine.scheduler.num_preemptions - preemptions_at_start
    level["simulated_s"] = now
    return LevelResult(level=level, records=measured)


def default_requests_per_level(concurrency: int) -> int:
    """Twenty requests per user, at least 200: the level's throughput then sits within ~5 % of
    the steady state (the start and the drain of a closed loop cost about one E2EL each)."""
    return max(200, 20 * concurrency)


def sweep(
    config: EngineConfig,
    mix: Mix,
    concurrencies: Sequence[int],
    *,
    requests_per_level: int | None = None,
    seed: int = 0,
    sla: Sla | None = None,
    on_level: Callable[[dict[str, Any]], None] | None = None,
    deadline: float | None = None,
) -> dict[str, Any]:
    """Every level of a closed-loop sweep: {"levels": [...], "sla_concurrency": N, "sla_reason": str}.

    Past `deadline` (`time.monotonic()`) it raises OutOfTime with the levels finished so far.
    """
    if not concurrencies:
        raise InputError("concurrency", "give at least one concurrency level")
    for concurrency in concurrencies:
        if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
            raise InputError("concurrency", f"levels must be whole numbers ≥ 1, got {concurrency!r}")
    if requests_per_level is not None and not 1 <= requests_per_level <= _MAX_REQUESTS_PER_LEVEL:
        raise InputError(
            "requests_per_level", f"must be between 1 and {_MAX_REQUESTS_PER_LEVEL}, got {requests_per_level}"
        )
    engine = SimEngine(config)  # refuse a profile that would not start before simulating anything
    levels: list[dict[str, Any]] = []
    for concurrency in concurrencies:
        n = requests_per_level or default_requests_per_level(concurrency)
        # One warm-up request per user fills the batch before measuring, as the load generator does.
        warmup = min(concurrency, n)
        # As the load generator does: prompts shortened to fit the context, outputs kept.
        specs = [fit_to_context(spec, engine.max_model_len) for spec in mix.sample(n + warmup, seed=seed)]
        try:
            result = run_level(config, specs, concurrency=concurrency, warmup=warmup, deadline=deadline)
        except OutOfTime as error:
            raise OutOfTime(concurrency=error.concurrency, levels=levels) from None
        levels.append(result.level)
        if on_level is not None:
            on_level(result.level)
    chosen, reason = operating_point(levels, sla or Sla(), verb="predicted")
    return {"levels": levels, "sla_concurrency": chosen, "sla_reason": reason}
