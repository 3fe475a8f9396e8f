"""Fit a node's host-side costs (`HostCosts`) to levels measured with the portal's load generator.

The simulator's GPU physics (roofline, all-reduces) come from the datasheet; what a
datasheet cannot say is how fast the node's CPU and vLLM version schedule a step, launch
a layer's kernels and stream a token. Those four constants are fitted here: the sweep is
simulated at the measured levels for candidate constants, and the candidates move to
where the predicted output tok/s and mean TPOT match the measured ones (squared log
errors, so a 10 % miss weighs the same at 1 user and at 256).

Only the constants the profile exercises are fitted: an eager run says nothing about
CUDA-graph launches and vice versa; the others keep their starting values. A pull
towards an informed start settles what the measurements leave open: at low levels of an
eager run the CPU bounds every step, so only the sum of per-step scheduling and kernel
launching is seen, and the pull keeps the scheduling near its starting value instead of
drifting along that ridge (docs/simulator.md, "Calibration"). A calibration given as the
starting point (say, from a CUDA-graph run of the same node) is what the pull holds to.

The search is a bounded Nelder-Mead simplex in log space, written out here: SciPy is not
a dependency of the project (docs/decisions.md, "Simulator calibration").
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeGuard

from inference.errors import InputError
from inference.loadgen.workloads import Mix, fit_to_context
from inference.sim.costs import (
    DEFAULT_HOST_COSTS,
    HOST_COST_BOUNDS,
    LOW_BATCH_SEQUENCES,
    HostCosts,
    is_factor,
)
from inference.sim.engine import EngineConfig, SimEngine
from inference.sim.virtual import run_level

SOURCE = "calibrate_from"
# A fit level is simulated with as many requests as were measured, but at most this many
# per user (and at least MIN_FIT_REQUESTS): past a few requests per user a level's
# throughput and TPOT move by a per cent or two, and the fit runs the level ~100 times.
FIT_REQUESTS_PER_USER = 4
MIN_FIT_REQUESTS = 16
# Weight of the pull towards the starting constants, per squared log-ratio. Per-step
# scheduling is the constant best known beforehand (1-2 ms on any host; a CUDA-graph run
# pins it down) and the one an eager run at low levels cannot tell from kernel launching,
# so it is held firmly: doubling it costs as much as a 15 % miss on one measured figure.
# The launch costs are what differ most between a V100 node and a slow VM in front of an
# H200 (10×), so they are held only loosely. The per-token work is seen at low levels only
# as the difference between 1 and 16 users, a few per cent and noisy on a VM, so it is held
# firmly to the informed start (`_informed_start`).
#
# The TTFT constants (issue 24): the API server's per-request work and the prefill factor
# are both seen in the low levels' TTFT, where they add up (a request's time before the
# engine, and its prefill step); throughput and TPOT of a loaded level see only the factor.
# Both are held moderately to the informed start, which shares the TTFT gap between them with
# the factor's share capped (`_ttft_start`); the TTFT spread over the level's prompts and the
# loaded levels move the factor. The low-load term is held loosely: only the lowest level sees it.
PRIOR_WEIGHTS: dict[str, float] = {
    "step_overhead_s": 0.05,
    "eager_launch_s_per_layer": 0.0005,
    "graph_launch_s_per_layer": 0.0005,
    "api_s_per_token": 0.05,
    "api_s_per_request": 0.02,
    "eager_prefill_factor": 0.02,
    "graph_prefill_factor": 0.02,
    "eager_low_batch_s_per_step": 0.002,
    "eager_low_batch_s_per_layer": 0.002,
}
# The prefill factor is fitted only from workloads whose prompts average at least this many
# tokens: with acceptance's `short-qa` (100-300) prefill is a few ms of TTFT, and on the H200
# node the fit pushed the factor to 1.4-1.7 there to follow how TTFT grew from 1 to 16 users,
# which then overpredicted a 14B model's TTFT under a 200-2,500-token workload by 30-60 %.
PREFILL_FIT_MIN_PROMPT_TOKENS = 800
# The weight of the TTFT spread's log-miss (its square counts a fifth of a mean's): three
# requests at one user make a noisy spread, and it only has to tell prefill from API work.
STD_TTFT_WEIGHT = math.sqrt(0.2)
# Stop when the simplex's objective values agree this closely, or after this many runs.
TOLERANCE = 1e-5
MAX_EVALUATIONS = 240
# Constants are searched as log(value + scale). Zero is a legal value of the seconds, so the
# scale keeps the log finite: 0.1 µs for the constants whose defaults are far above it, and
# about the size that matters for those whose default is zero (a step of the search then moves
# them by a fraction of that size, not by a factor of a nothing).
_FLOOR_S = 1e-7
_SEARCH_SCALE: dict[str, float] = {
    "api_s_per_request": 2e-3,
    "eager_low_batch_s_per_step": 1e-3,
    "eager_low_batch_s_per_layer": 30e-6,
}


@dataclass(frozen=True)
class MeasuredLevel:
    """What the fit uses from one closed-loop level of `manage.py bench --json`."""

    concurrency: int
    output_throughput: float  # tok/s
    mean_tpot_ms: float
    requests: int  # measured requests (completed + failed)
    warmup: int | None = None  # warm-up requests sent first; None: one per user, as by default
    mean_ttft_ms: float | None = None  # None: the report has none, the fit leaves TTFT alone
    std_ttft_ms: float | None = None  # the spread of TTFT over the level's prompts (see _misses)


@dataclass(frozen=True)
class Fit:
    """The fitted constants and how well they reproduce the levels they were fitted on."""

    host: HostCosts
    fitted: tuple[str, ...]
    levels: list[dict[str, Any]]
    evaluations: int

    def as_dict(self) -> dict[str, Any]:
        return {
            "calibration": self.host.as_dict(),
            "fitted": list(self.fitted),
            "levels": self.levels,
            "evaluations": self.evaluations,
        }


def measured_levels(report: object, *, only: Sequence[int] | None = None) -> list[MeasuredLevel]:
    """The closed-loop levels of a bench report, optionally only those at `only`'s concurrencies.

    Open-loop (request-rate) levels and levels where nothing completed are skipped; a
    report with nothing left to fit is an InputError naming `calibrate_from`.
    """
    if not isinstance(report, dict) or not isinstance(report.get("levels"), list):
        raise InputError(SOURCE, 'is not a report of `manage.py bench --json` (no "levels" list)')
    levels: list[MeasuredLevel] = []
    for number, level in enumerate(report["levels"], start=1):
        if not isinstance(level, dict):
            raise InputError(SOURCE, f"level {number} is not an object")
        concurrency = level.get("concurrency")
        if concurrency is None:
            continue  # an open-loop level: no fixed number of users to simulate
        throughput, tpot = level.get("output_throughput"), level.get("mean_tpot_ms")
        if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
            raise InputError(SOURCE, f"level {number}: concurrency {concurrency!r} is not a whole number ≥ 1")
        if not level.get("completed") or not _positive(throughput) or not _positive(tpot):
            continue  # nothing completed, or one-token outputs: no rate or TPOT to fit
        requests = int(level.get("completed", 0)) + int(level.get("failed", 0) or 0)
        warmup = level.get("warmup_requests")
        warmup = warmup if isinstance(warmup, int) and not isinstance(warmup, bool) and warmup >= 0 else None
        ttft, spread = level.get("mean_ttft_ms"), level.get("std_ttft_ms")
        ttft = float(ttft) if _positive(ttft) else None
        spread = float(spread) if ttft is not None and _positive(spread) else None
        levels.append(
            MeasuredLevel(concurrency, float(throughput), float(tpot), requests, warmup, ttft, spread)
        )
    if only is not None:
        missing = sorted(set(only) - {level.concurrency for level in levels})
        if missing:
            raise InputError(
                SOURCE, f"has no measured level at concurrency {', '.join(map(str, missing))} to fit on"
            )
        levels = [level for level in levels if level.concurrency in set(only)]
    if not levels:
        raise InputError(SOURCE, "has no closed-loop level with completed requests to fit on")
    return levels


def _positive(value: object) -> TypeGuard[float]:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return math.isfinite(value) and value > 0


def mean_prompt_tokens(mix: Mix) -> float:
    """The mean prompt length a mix draws (the middle of each bucket's range, by share)."""
    total = sum(bucket.share for bucket in mix.buckets) or 1.0
    return sum(bucket.share * sum(bucket.prompt_range) / 2 for bucket in mix.buckets) / total


def fitted_names(
    config: EngineConfig, measured: Sequence[MeasuredLevel] | None = None
) -> tuple[str, ...]:
    """The constants a run of this profile (and these measured levels) exercises, hence can fit.

    The launch work and the prefill factor are the run's mode's; the per-request API work
    needs a measured TTFT; the eager low-load term needs an eager level below
    LOW_BATCH_SEQUENCES users and one at or above it, to tell it from the launch work.
    """
    eager = config.profile.enforce_eager
    names = ["step_overhead_s", "eager_launch_s_per_layer" if eager else "graph_launch_s_per_layer"]
    names.append("api_s_per_token")
    with_ttft = measured is None or any(level.mean_ttft_ms for level in measured)
    if with_ttft:
        names.append("api_s_per_request")
    # Not fitted: `api_serial_s_per_request` (the front end's one-at-a-time work). Two levels cannot
    # tell it from scheduling: on a synthetic node with none, a fit on 1 and 4 users put 6.5 ms in it,
    # 2.7 ms in scheduling and the launch work 19 % low; on the recorded H200 runs it came out at
    # 0.04-0.3 ms and moved no level by more than 2 % (docs/simulator.md, "Time to first token").
    names.append("eager_prefill_factor" if eager else "graph_prefill_factor")
    if eager and measured is not None:
        users = [level.concurrency for level in measured]
        if min(users) < LOW_BATCH_SEQUENCES <= max(users):
            # Per layer, not per step (issue 40): the host's extra time at small batches is a slower
            # launch of each layer, so it carries to a model of another depth.
            names.append("eager_low_batch_s_per_layer")
    return tuple(names)


def simulate_levels(
    config: EngineConfig, mix: Mix, measured: Sequence[MeasuredLevel], *, seed: int = 0
) -> list[dict[str, Any]]:
    """The simulated level for each measured one, with the fit's request counts.

    The warm-up is the measured one when the report says (the bench's `--warmup`),
    else one request per user, as the bench sends by default.
    """
    engine = SimEngine(config)
    results = []
    for level in measured:
        n = min(level.requests, max(MIN_FIT_REQUESTS, FIT_REQUESTS_PER_USER * level.concurrency))
        warmup = level.warmup if level.warmup is not None else min(level.concurrency, n)
        specs = [fit_to_context(spec, engine.max_model_len) for spec in mix.sample(n + warmup, seed=seed)]
        results.append(run_level(config, specs, concurrency=level.concurrency, warmup=warmup).level)
    return results


def _misses(predicted: Sequence[dict[str, Any]], measured: Sequence[MeasuredLevel]) -> list[float]:
    """log(predicted ÷ measured) for output tok/s, mean TPOT and (where measured) mean TTFT of each level."""
    misses = []
    for guess, level in zip(predicted, measured, strict=True):
        throughput, tpot = guess.get("output_throughput"), guess.get("mean_tpot_ms")
        # A level the simulator could not complete is as wrong as a level can be.
        misses.append(math.log(throughput / level.output_throughput) if _positive(throughput) else 10.0)
        misses.append(math.log(tpot / level.mean_tpot_ms) if _positive(tpot) else 10.0)
        if level.mean_ttft_ms is not None:
            ttft = guess.get("mean_ttft_ms")
            misses.append(math.log(ttft / level.mean_ttft_ms) if _positive(ttft) else 10.0)
        if level.std_ttft_ms is not None and level.mean_ttft_ms is not None:  # a spread comes with a mean
            # The spread says how TTFT grows with the prompt: the level's prompts differ in length
            # (the simulated ones are the same draws), so the prefill rate shows in it, while the
            # API server's per-request work, the same for every prompt, does not. The mean alone
            # cannot tell the two apart at low load.
            # A tenth of the mean is added to both: where the prompts hardly differ (a fixed
            # workload) the spread is noise, and a ratio of two noises must not steer the fit.
            floor = 0.1 * level.mean_ttft_ms
            spread = guess.get("std_ttft_ms")
            spread = spread if isinstance(spread, int | float) and math.isfinite(spread) else None
            miss = math.log((spread + floor) / (level.std_ttft_ms + floor)) if spread is not None else 10.0
            misses.append(miss * STD_TTFT_WEIGHT)
    return misses


def _scale(name: str) -> float:
    return 0.0 if is_factor(name) else _SEARCH_SCALE.get(name, _FLOOR_S)


def fit_host_costs(
    config: EngineConfig,
    mix: Mix,
    measured: Sequence[MeasuredLevel],
    *,
    seed: int = 0,
    on_evaluation: Callable[[HostCosts, float], None] | None = None,
) -> Fit:
    """Host costs for `config` (its `host` is the starting point) that reproduce `measured`."""
    if not measured:
        raise InputError(SOURCE, "has no closed-loop level with completed requests to fit on")
    start = config.host
    names = fitted_names(config, measured)
    if mean_prompt_tokens(mix) < PREFILL_FIT_MIN_PROMPT_TOKENS:
        # Short prompts: prefill is a few ms of TTFT, which cannot tell a prefill factor from the
        # per-request work or from queueing; it keeps its starting value (1 by default).
        names = tuple(name for name in names if not is_factor(name))
    lows = [math.log(HOST_COST_BOUNDS[name][0] + _scale(name)) for name in names]
    highs = [math.log(HOST_COST_BOUNDS[name][1] + _scale(name)) for name in names]
    lowest = min(measured, key=lambda level: level.concurrency)
    guess = simulate_levels(config, mix, [lowest], seed=seed)[0]
    first = _informed_start(config, names, start, lowest, guess)
    if "api_s_per_request" in names and lowest.mean_ttft_ms is not None:
        # The TTFT gap is shared out once the host's part of a step is known: a host-bound
        # step delays its tokens by the next step's launch work (`StepTime.output_lag_s`).
        informed = replace(first, **{name: getattr(start, name) for name in _TTFT_NAMES})
        guess = simulate_levels(replace(config, host=informed), mix, [lowest], seed=seed)[0]
        first = replace(informed, **_ttft_start(names, start, lowest, guess))
    origin = [math.log(getattr(first, name) + _scale(name)) for name in names]
    evaluations = 0

    def costs_at(point: Sequence[float]) -> HostCosts:
        # Clamped: exp(log(bound + scale)) − scale can land a rounding error past the bound itself.
        values = {
            name: min(max(HOST_COST_BOUNDS[name][0], math.exp(x) - _scale(name)), HOST_COST_BOUNDS[name][1])
            for name, x in zip(names, point, strict=True)
        }
        return replace(start, **values)

    def objective(point: Sequence[float]) -> float:
        nonlocal evaluations
        evaluations += 1
        host = costs_at(point)
        predicted = simulate_levels(replace(config, host=host), mix, measured, seed=seed)
        value = sum(miss * miss for miss in _misses(predicted, measured))
        value += sum(
            PRIOR_WEIGHTS[name] * (x - x0) ** 2 for name, x, x0 in zip(names, point, origin, strict=True)
        )
        if on_evaluation is not None:
            on_evaluation(host, value)
        return value

    best = _nelder_mead(objective, list(origin), lows, highs)
    if evaluations < MAX_EVALUATIONS - 2 * len(names):
        # Restarted once from the best point with a fresh simplex: a collapsed simplex on these
        # ridges stops short of the minimum (the classic remedy; the budget is shared).
        best = _nelder_mead(objective, best, lows, highs, budget=MAX_EVALUATIONS - evaluations)
    host = costs_at(best)
    predicted = simulate_levels(replace(config, host=host), mix, measured, seed=seed)
    levels = [
        {
            "concurrency": level.concurrency,
            "measured_output_throughput": level.output_throughput,
            "predicted_output_throughput": guess.get("output_throughput"),
            "measured_mean_tpot_ms": level.mean_tpot_ms,
            "predicted_mean_tpot_ms": guess.get("mean_tpot_ms"),
            "measured_mean_ttft_ms": level.mean_ttft_ms,
            "predicted_mean_ttft_ms": guess.get("mean_ttft_ms"),
        }
        for guess, level in zip(predicted, measured, strict=True)
    ]
    return Fit(host=host, fitted=names, levels=levels, evaluations=evaluations)


def _informed_start(
    config: EngineConfig,
    names: Sequence[str],
    start: HostCosts,
    level: MeasuredLevel,
    predicted: dict[str, Any],
) -> HostCosts:
    """Where the search starts and what it is pulled towards: the lowest level's TPOT
    explained by the host costs.

    A step costs scheduling plus the larger of the GPU's part and the CPU's part (launch
    work plus per-token work). With the starting constants the lowest level's TPOT predicts
    that step; a measured TPOT beyond the GPU's part is CPU work (the eager VM case), a
    shorter or slightly longer one is scheduling. Without this the simplex, started at the
    V100-era constants, can settle on the flat ridge where scheduling explains everything.

    CPU work found this way scales the per-token API work with it, by the square root of
    the launch work's factor: both are Python on the same host, but part of the per-token
    work is vectorised and does not slow down with the interpreter. On the recorded H200
    runs (tests/sim/data/h200) scaling it fully overpredicted the GQA model's 256-user
    TPOT by 24 %, not scaling it underpredicted the 64-user TPOT by 22 %; the geometric
    middle holds both models (docs/simulator.md). The levels then refine both.
    """
    tpot_s, guess_ms = level.mean_tpot_ms / 1000, predicted.get("mean_tpot_ms")
    if not _positive(guess_ms):
        return start
    launch_name = names[1]
    layers = config.model.num_layers
    scheduling = start.step_overhead_s
    launch = getattr(start, launch_name) * layers
    gpu = guess_ms / 1000 - scheduling  # the GPU's part, or the CPU's part if that bound the step
    values: dict[str, float] = {}
    if tpot_s - scheduling > max(gpu, launch) * 1.05:
        per_token = start.api_s_per_token * level.concurrency
        factor = (tpot_s - scheduling) / (launch + per_token) if launch + per_token > 0 else 1.0
        values[launch_name] = getattr(start, launch_name) * factor
        values["api_s_per_token"] = start.api_s_per_token * math.sqrt(factor)
    else:
        values["step_overhead_s"] = max(0.0, scheduling + tpot_s - guess_ms / 1000)
    for name, value in values.items():
        low, high = HOST_COST_BOUNDS[name]
        values[name] = min(max(value, low), high)
    return replace(start, **values)


_TTFT_NAMES = ("api_s_per_request", "eager_prefill_factor", "graph_prefill_factor")
# The most the informed start puts in the prefill factor (see `_ttft_start`): the recorded H200
# runs fitted 1.05-1.12, and the 14B run of issue 24 (tok/s over, TPOT and TTFT under at
# factor 1) points the same way.
MAX_START_PREFILL_FACTOR = 1.25


def _ttft_start(
    names: Sequence[str], start: HostCosts, level: MeasuredLevel, predicted: dict[str, Any]
) -> dict[str, float]:
    """The TTFT constants' start: the lowest level's TTFT gap shared between the API server's
    per-request work and the prefill factor.

    Half the gap is per-request work and half is prefill, but the factor starts at most
    `MAX_START_PREFILL_FACTOR` times its starting value: a workload of short prompts
    (acceptance's `short-qa`) cannot tell the two apart, and half its gap in a few-ms
    prefill would make a factor of 2 that a long-prompt workload then pays. The rest of the
    gap is per-request work. The spread of TTFT and the loaded levels move the factor where
    they show it. A gap below zero shrinks the factor (the engine's part of TTFT, which the
    prefill step dominates at low load).
    """
    guess_ms = predicted.get("mean_ttft_ms")
    if "api_s_per_request" not in names or level.mean_ttft_ms is None or not _positive(guess_ms):
        return {}
    factor_name = next((name for name in names if is_factor(name)), None)
    gap = (level.mean_ttft_ms - guess_ms) / 1000
    if factor_name is None:  # the prefill factor is not fitted: the gap is per-request work
        values = {"api_s_per_request": max(0.0, start.api_s_per_request + gap)}
    else:
        engine = max(guess_ms / 1000 - start.api_s_per_request, 1e-4)
        prefill_gap = gap if gap <= 0 else min(gap / 2, (MAX_START_PREFILL_FACTOR - 1) * engine)
        values = {
            "api_s_per_request": start.api_s_per_request + max(0.0, gap - prefill_gap),
            factor_name: getattr(start, factor_name) * max(0.25, (engine + prefill_gap) / engine),
        }
    return {
        name: min(max(value, HOST_COST_BOUNDS[name][0]), HOST_COST_BOUNDS[name][1])
        for name, value in values.items()
    }


def _nelder_mead(
    objective: Callable[[list[float]], float],
    start: list[float],
    lows: list[float],
    highs: list[float],
    *,
    budget: int = MAX_EVALUATIONS,
) -> list[float]:
    """Minimise `objective` inside the box [lows, highs] (points are clipped into it), in at most
    about `budget` evaluations."""
    dims = len(start)

    def clip(point: list[float]) -> list[float]:
        return [min(max(x, low), high) for x, low, high in zip(point, lows, highs, strict=True)]

    # The first simplex reaches ×1.5 along each axis (towards the far side when a bound is near).
    simplex = [clip(list(start))]
    for axis in range(dims):
        point = list(simplex[0])
        step = math.log(1.5)
        point[axis] += step if point[axis] + step <= highs[axis] else -step
        simplex.append(clip(point))
    values = [objective(point) for point in simplex]
    evaluations = len(values)
    while evaluations < budget:
        order = sorted(range(dims + 1), key=values.__getitem__)
        simplex = [simplex[i] for i in order]
        values = [values[i] for i in order]
        if values[-1] - values[0] <= TOLERANCE:
            break
        centroid = [sum(point[d] for point in simplex[:-1]) / dims for d in range(dims)]
        worst = simplex[-1]

        def toward(
            scale: float, *, centroid: list[float] = centroid, worst: list[float] = worst
        ) -> list[float]:
            return clip([c + scale * (c - w) for c, w in zip(centroid, worst, strict=True)])

        reflected = toward(1.0)
        reflected_value = objective(reflected)
        evaluations += 1
        if reflected_value < values[0]:
            expanded = toward(2.0)
            expanded_value = objective(expanded)
            evaluations += 1
            if expanded_value < reflected_value:
                simplex[-1], values[-1] = expanded, expanded_value
            else:
                simplex[-1], values[-1] = reflected, reflected_value
            continue
        if reflected_value < values[-2]:
            simplex[-1], values[-1] = reflected, reflected_value
            continue
        contracted = toward(-0.5) if reflected_value >= values[-1] else toward(0.5)
        contracted_value = objective(contracted)
        evaluations += 1
        if contracted_value < min(values[-1], reflected_value):
            simplex[-1], values[-1] = contracted, contracted_value
            continue
        # Shrink every point halfway towards the best one.
        for index in range(1, dims + 1):
            simplex[index] = clip([(b + p) / 2 for b, p in zip(simplex[0], simplex[index], strict=True)])
            values[index] = objective(simplex[index])
            evaluations += 1
    best = min(range(len(values)), key=values.__getitem__)
    return simplex[best]


__all__ = [
    "DEFAULT_HOST_COSTS",
    "Fit",
    "MeasuredLevel",
    "fit_host_costs",
    "fitted_names",
    "measured_levels",
    "simulate_levels",
]
