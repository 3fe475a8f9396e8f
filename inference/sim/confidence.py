"""How sure the twin is of a prediction: a range per figure, or a plain "cannot say".

A calibrated prediction is as good as (a) how well the calibration reproduced the levels it was
fitted on (its residuals), (b) how steady the node's host is (eager steps are host-bound, and the
host's speed moved 4-40 % between levels on the lent VMs), and (c) how far the question is from
what was calibrated: another depth of model, another workload, a level far above the calibrated
ones. Each adds to a log-width around the predicted figure; `Range.pessimistic` is the end the
planner and the SLA cap use. Past the limits below the twin says why instead of giving a number
(`Confidence.outside`). docs/simulator.md, "How sure the twin is", says where each width came from.

No Django here: `portal/deployments/predict.py` builds the basis when it fits and applies the
judgement to every predicted level.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from inference.errors import InputError
from inference.loadgen.workloads import Mix

# The figures a range is given for; True where a higher value is the pessimistic one.
HIGHER_IS_WORSE: dict[str, bool] = {
    "output_throughput": False,
    "mean_tpot_ms": True,
    "p95_tpot_ms": True,
    "mean_ttft_ms": True,
    "p95_ttft_ms": True,
}
# Which fit residual stands for each figure (the fit compares means; a P95 takes its mean's).
_RESIDUAL_OF = {
    "output_throughput": "output_throughput",
    "mean_tpot_ms": "mean_tpot_ms",
    "p95_tpot_ms": "mean_tpot_ms",
    "mean_ttft_ms": "mean_ttft_ms",
    "p95_ttft_ms": "mean_ttft_ms",
}
_KIND = {"output_throughput": "tok", "mean_tpot_ms": "tpot", "p95_tpot_ms": "tpot"}


def _kind(metric: str) -> str:
    return _KIND.get(metric, "ttft")


# --- widths, as log-ratios (0.10 ≈ ±10 %) ------------------------------------------------------
# The least a figure can be trusted to even on the levels it was fitted on: a repeated level on one
# VM moved 4 % (tests/sim/data/h200-layers/repeat-*), TTFT over a few requests more.
FLOOR = {"tok": 0.05, "tpot": 0.05, "ttft": 0.10}
# Eager steps are host-bound and the host's speed is not steady from one level to the next: on one
# VM the eager decode step was layers × 0.72 ms with an 18 % rms spread over 20 levels of 4 shapes
# (docs/gpu-runs.md, 2026-12-04), one level of each engine ~40 % faster than its neighbours. Timed
# inside vLLM on another VM (2026-12-07, tests/sim/data/h100-probe/host-launch.json), a layer's launch
# had the same spread for a 32-layer 7B and a 40-layer 24B (p10 0.41-0.43, median 0.56-0.61, p90
# 0.91-0.92 ms), while a level's median sat 0.69-1.15× its engine's mean: a log rms of 0.23 per level.
EAGER_HOST = {"tok": 0.25, "tpot": 0.25, "ttft": 0.10}
# Per unit of |ln(layers asked ÷ layers calibrated)|. Eager: the 7B's step scaled by 48/32 layers
# predicted the 14B's within −9…+15 % on one VM (0.15 ÷ ln 1.5 ≈ 0.37); CUDA graphs: the GPU part
# is datasheet physics and the 7B-fitted graphs calibration held the 14B within 6 %.
SHAPE = {
    True: {"tok": 0.35, "tpot": 0.35, "ttft": 0.35},  # eager
    False: {"tok": 0.10, "tpot": 0.10, "ttft": 0.25},  # CUDA graphs
}
# Per unit of |ln(mean prompt asked ÷ calibrated)| and of the mean output: prefill's share of the
# steps moves with the prompt; TTFT most of all.
WORKLOAD = {"tok": 0.04, "tpot": 0.04, "ttft": 0.10}
# Per doubling of the users above the highest calibrated level: calibrated on 1 and 16 users, the
# recorded 64- and 256-user levels (2 and 4 doublings up) missed by up to 11 % on tok/s and TPOT
# and 9 % on TTFT (tests/sim/data/h200, `bench-*`), and TTFT at the top is what the SLA cap reads.
LEVEL = {"tok": 0.03, "tpot": 0.03, "ttft": 0.08}
# A calibration saved before issue 40 carries no basis: its distance from the question is unknown.
UNKNOWN_BASIS = {"tok": 0.15, "tpot": 0.15, "ttft": 0.25}
# Uncalibrated (the V100-era defaults): the field guide's reference run is within ±21 % on tok/s
# (docs/simulator.md, "Fidelity"); TTFT without a node's per-request work was 30-70 % low on every
# recorded H200 level, so its range reaches three times up and only a little down.
UNCALIBRATED = {"tok": (0.25, 0.25), "tpot": (0.30, 0.30), "ttft": (0.10, math.log(3.0))}

# --- where the twin stops giving numbers -------------------------------------------------------
MAX_LAYER_RATIO = 4.0  # a model 4× deeper or shallower than the calibrated one
MAX_LEVEL_RATIO = 32.0  # 32× the highest calibrated level (1 and 16 users calibrate up to 512)
MAX_PROMPT_RATIO = 20.0  # prompts 20× longer or shorter on average


@dataclass(frozen=True)
class CalibrationBasis:
    """What a calibration was fitted on: the distance of a later question is measured from it."""

    gpu: str
    eager: bool
    layers: int
    mean_prompt_tokens: float
    mean_output_tokens: float
    max_concurrency: int
    # Per figure, the largest |ln(predicted ÷ measured)| over the fit levels.
    residuals: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "gpu": self.gpu,
            "eager": self.eager,
            "layers": self.layers,
            "mean_prompt_tokens": round(self.mean_prompt_tokens, 1),
            "mean_output_tokens": round(self.mean_output_tokens, 1),
            "max_concurrency": self.max_concurrency,
            "residuals": {name: round(value, 4) for name, value in self.residuals.items()},
        }

    @classmethod
    def from_dict(cls, data: object) -> CalibrationBasis:
        """As `as_dict` wrote it; InputError("calibration") says what is wrong."""
        if not isinstance(data, dict):
            raise InputError("calibration", f"basis must be an object, got {data!r}")
        try:
            residuals = {
                str(name): float(value)
                for name, value in (data.get("residuals") or {}).items()
                if name in ("output_throughput", "mean_tpot_ms", "mean_ttft_ms")
            }
            basis = cls(
                gpu=str(data["gpu"])[:64],
                eager=bool(data["eager"]),
                layers=int(data["layers"]),
                mean_prompt_tokens=float(data["mean_prompt_tokens"]),
                mean_output_tokens=float(data["mean_output_tokens"]),
                max_concurrency=int(data["max_concurrency"]),
                residuals=residuals,
            )
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise InputError("calibration", f"basis is not readable: {error}") from None
        numbers = (basis.layers, basis.mean_prompt_tokens, basis.mean_output_tokens, basis.max_concurrency)
        if not all(math.isfinite(value) and 0 < value <= 10_000_000 for value in numbers):
            raise InputError("calibration", "basis: layers, token means and concurrency must be positive")
        if not all(math.isfinite(value) and 0 <= value <= 10 for value in residuals.values()):
            raise InputError("calibration", "basis: residuals must be between 0 and 10")
        return basis


@dataclass(frozen=True)
class Question:
    """What a prediction is asked for, in the basis's terms (concurrency per level)."""

    gpu: str
    eager: bool
    layers: int
    mean_prompt_tokens: float
    mean_output_tokens: float
    is_volta: bool = False


@dataclass(frozen=True)
class Range:
    """A predicted figure and the interval the twin stands behind."""

    low: float
    value: float
    high: float
    higher_is_worse: bool

    @property
    def pessimistic(self) -> float:
        return self.high if self.higher_is_worse else self.low


@dataclass(frozen=True)
class Confidence:
    """Per figure a Range, or `outside` (why the twin gives no number) with no ranges."""

    ranges: dict[str, Range]
    outside: str = ""
    notes: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        return {
            "range": {name: [r.low, r.high] for name, r in self.ranges.items()} or None,
            "outside": self.outside,
            "notes": list(self.notes),
        }


def mix_means(mix: Mix) -> tuple[float, float]:
    """The mean prompt and output lengths a mix draws (the middle of each bucket, by share)."""
    total = sum(bucket.share for bucket in mix.buckets) or 1.0
    prompt = sum(bucket.share * sum(bucket.prompt_range) / 2 for bucket in mix.buckets) / total
    output = sum(bucket.share * sum(bucket.output_range) / 2 for bucket in mix.buckets) / total
    return prompt, output


def basis_of(
    *, gpu: str, eager: bool, layers: int, mix: Mix, fit_levels: Sequence[dict[str, Any]]
) -> CalibrationBasis:
    """What a calibration was fitted on (`Fit.levels` of `fit_host_costs`), to store with it."""
    prompt, output = mix_means(mix)
    return CalibrationBasis(
        gpu=gpu,
        eager=eager,
        layers=layers,
        mean_prompt_tokens=prompt,
        mean_output_tokens=output,
        max_concurrency=max(level["concurrency"] for level in fit_levels),
        residuals=fit_residuals(fit_levels),
    )


def fit_residuals(fit_levels: Sequence[dict[str, Any]]) -> dict[str, float]:
    """The largest |ln(predicted ÷ measured)| per figure over a Fit's levels."""
    residuals: dict[str, float] = {}
    for metric in ("output_throughput", "mean_tpot_ms", "mean_ttft_ms"):
        misses = [
            abs(math.log(level[f"predicted_{metric}"] / level[f"measured_{metric}"]))
            for level in fit_levels
            if (level.get(f"predicted_{metric}") or 0) > 0 and (level.get(f"measured_{metric}") or 0) > 0
        ]
        if misses:
            residuals[metric] = max(misses)
    return residuals


def _distance(
    basis: CalibrationBasis, question: Question, concurrency: int
) -> tuple[str, dict[str, Any], list[str]]:
    """(why it is outside or "", {kind: width}, notes) for a calibrated question."""
    notes: list[str] = []
    if question.gpu != basis.gpu:
        return f"calibrated on {basis.gpu}, asked for {question.gpu}: a calibration is one node's", {}, []
    if question.eager != basis.eager:
        mode = "eager" if basis.eager else "CUDA-graph"
        return f"the calibration saw {mode} levels only: the other mode's host costs are unknown", {}, []
    layers = abs(math.log(question.layers / basis.layers))
    if layers > math.log(MAX_LAYER_RATIO):
        why = f"{question.layers} layers against the calibrated {basis.layers}: over {MAX_LAYER_RATIO:g}×"
        return why, {}, []
    prompt = abs(math.log(max(question.mean_prompt_tokens, 1) / max(basis.mean_prompt_tokens, 1)))
    output = abs(math.log(max(question.mean_output_tokens, 1) / max(basis.mean_output_tokens, 1)))
    if prompt > math.log(MAX_PROMPT_RATIO):
        return (
            f"prompts of ~{question.mean_prompt_tokens:.0f} tokens against the calibrated "
            f"~{basis.mean_prompt_tokens:.0f}: over {MAX_PROMPT_RATIO:g}×"
        ), {}, []
    if concurrency > MAX_LEVEL_RATIO * basis.max_concurrency:
        return (
            f"{concurrency} users is over {MAX_LEVEL_RATIO:g}× the highest calibrated level "
            f"({basis.max_concurrency})"
        ), {}, []
    doublings = max(0.0, math.log2(concurrency / basis.max_concurrency))
    widths = {}
    for kind in ("tok", "tpot", "ttft"):
        widths[kind] = (
            SHAPE[basis.eager][kind] * layers
            + WORKLOAD[kind] * (prompt + output)
            + LEVEL[kind] * doublings
            + (EAGER_HOST[kind] if basis.eager else 0.0)
        )
    if layers > 0.01:
        notes.append(f"another depth ({question.layers} layers, calibrated {basis.layers})")
    if prompt + output > 0.1:
        notes.append("another workload")
    if doublings > 0:
        notes.append(f"{doublings:.1f} doublings above the calibrated {basis.max_concurrency} users")
    return "", widths, notes


def judge(
    level: dict[str, Any], *, basis: CalibrationBasis | None, calibrated: bool, question: Question
) -> Confidence:
    """The ranges of one predicted level (a `summarize_level` dict with its concurrency)."""
    concurrency = int(level.get("concurrency") or 1)
    residuals: dict[str, float] = {}
    notes: list[str] = []
    if not calibrated:
        if question.eager and not question.is_volta:
            return Confidence(
                {},
                outside=(
                    "uncalibrated eager mode on a GPU faster than the V100 the defaults describe: the "
                    "host bounds its steps (1.2-3.3× off on an H200); calibrate the node first"
                ),
            )
        lows_highs = {kind: UNCALIBRATED[kind] for kind in ("tok", "tpot", "ttft")}
        notes.append("uncalibrated: the V100-era host defaults")
    else:
        if basis is None:
            widths = dict(UNKNOWN_BASIS)
            if question.eager:
                widths = {kind: widths[kind] + EAGER_HOST[kind] for kind in widths}
            notes.append("the calibration does not say what it was fitted on")
        else:
            outside, widths, notes = _distance(basis, question, concurrency)
            if outside:
                return Confidence({}, outside=outside)
            residuals = basis.residuals
        lows_highs = {kind: (widths[kind], widths[kind]) for kind in widths}
    ranges = {}
    for metric, worse_high in HIGHER_IS_WORSE.items():
        value = level.get(metric)
        if not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
            continue
        kind = _kind(metric)
        base = max(FLOOR[kind], residuals.get(_RESIDUAL_OF[metric], 0.0))
        down, up = lows_highs[kind]
        # The optimistic side's width for an uncalibrated TTFT is small, its pessimistic side large.
        if not worse_high:
            down, up = up, down
        ranges[metric] = Range(
            low=value * math.exp(-(base + down)), value=value, high=value * math.exp(base + up),
            higher_is_worse=worse_high,
        )  # fmt: skip
    return Confidence(ranges, notes=tuple(notes))


def pessimistic_level(level: dict[str, Any], confidence: Confidence) -> dict[str, Any]:
    """The level with each judged figure at its pessimistic end (what the SLA cap is chosen on)."""
    worst = dict(level)
    if confidence.outside:
        worst["outside"] = confidence.outside
    for metric, interval in confidence.ranges.items():
        worst[metric] = interval.pessimistic
    return worst


__all__ = [
    "CalibrationBasis",
    "Confidence",
    "Question",
    "Range",
    "basis_of",
    "fit_residuals",
    "judge",
    "mix_means",
    "pessimistic_level",
]
