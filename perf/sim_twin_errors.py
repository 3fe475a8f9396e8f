"""How far the simulator's twin is from recorded GPU runs: tok/s, mean TPOT and mean TTFT, per level.

Reads `manage.py bench --json` reports recorded on a GPU node (default: tests/sim/data/h200/*.json),
fits the node's host costs per mode (eager / CUDA graphs) on one model's levels (by default
llama-2-7b-chat-hf at 1 and 16 users, the fixtures' acceptance levels), then predicts every
recorded level of every report, with the request and warm-up counts it was measured with,
uncalibrated and calibrated, and prints the errors as a markdown table (and `--json` for both).

    .venv/bin/python perf/sim_twin_errors.py [--fit-model llama-2-7b-chat-hf] [--fit-levels 1,16]
        [--data tests/sim/data/h200] [--json out.json]
    .venv/bin/python perf/sim_twin_errors.py --decode-steps   # the eager host evidence, in seconds

`--decode-steps` fits nothing: for every recorded level up to 64 users it sets the median
inter-token gap (a decode step's length) beside the simulated GPU part of a decode-only step at
that level, and reads off the host time per layer the step implies, with the host overlapping the
GPU's work (as the simulator models it) and in series with it (docs/simulator.md, "Why the held-out
eager levels miss").

The profile of each report is read from its `engine.argv` (the vLLM command line it was served
with); the GPU is an H200 unless `--gpu` says otherwise.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from inference.hardware import get_gpu  # noqa: E402
from inference.hf_config import resolve_model_config  # noqa: E402
from inference.loadgen.workloads import fit_to_context, load_mix  # noqa: E402
from inference.profile import ProfileSettings  # noqa: E402
from inference.sim.calibration import fit_host_costs, measured_levels  # noqa: E402
from inference.sim.confidence import Question, basis_of, judge, mix_means  # noqa: E402
from inference.sim.costs import (  # noqa: E402
    DEFAULT_HOST_COSTS,
    ScheduledChunk,
    StepCostModel,
    describe_calibration,
)
from inference.sim.engine import EngineConfig, SimEngine  # noqa: E402
from inference.sim.virtual import run_level  # noqa: E402


def profile_from_argv(argv: str) -> ProfileSettings:
    """The flags of a recorded vLLM command line that the simulator models."""
    words = shlex.split(argv)
    values: dict = {"dtype": "float16", "tensor_parallel_size": 1}

    def value(flag: str) -> str | None:
        return words[words.index(flag) + 1] if flag in words else None

    for flag, name, kind in (
        ("--tensor-parallel-size", "tensor_parallel_size", int),
        ("--gpu-memory-utilization", "gpu_memory_utilization", float),
        ("--max-num-seqs", "max_num_seqs", int),
        ("--block-size", "block_size", int),
        ("--max-model-len", "max_model_len", int),
        ("--max-num-batched-tokens", "max_num_batched_tokens", int),
    ):
        if value(flag) is not None:
            values[name] = kind(value(flag))
    values["enable_prefix_caching"] = "--enable-prefix-caching" in words
    values["enable_chunked_prefill"] = "--no-enable-chunked-prefill" not in words
    values["enforce_eager"] = "--enforce-eager" in words
    return ProfileSettings(**values)


def load_report(path: Path) -> dict:
    report = json.loads(path.read_text())
    engine = report.get("engine") or {}
    shape = engine.get("shape") or report["model"]
    if shape.startswith("accept-"):  # node acceptance registers the reference as accept-<shape>-<dtype>
        shape = shape.removeprefix("accept-").rsplit("-", 1)[0]
    argv = engine.get("argv") or (
        # An acceptance record carries no command line: its profile on a GPU is the fixtures' one
        # (tests/sim/data/h200/README.md), eager or not as the record says.
        "--max-model-len 4096 --max-num-batched-tokens 8192 --gpu-memory-utilization 0.9 "
        "--max-num-seqs 256 --block-size 16" + (" --enforce-eager" if engine.get("enforce_eager") else "")
    )
    profile = profile_from_argv(argv)
    mode = "eager" if profile.enforce_eager else "graphs"
    layers = engine.get("layers")  # a shape cut to fewer layers (`gpu_run.py sweep`, issue 40)
    return {
        "path": path, "report": report, "shape": shape, "layers": layers, "profile": profile, "mode": mode,
    }  # fmt: skip


def model_of(item: dict):
    """The report's model shape, with the layer count it was served with."""
    model = resolve_model_config(item["shape"])
    return replace(model, num_layers=item["layers"]) if item.get("layers") else model


def simulate(config: EngineConfig, mix, level) -> dict:
    """One measured level simulated with its own request and warm-up counts."""
    engine = SimEngine(config)
    warmup = level.warmup if level.warmup is not None else level.concurrency
    sample = mix.sample(level.requests + warmup, seed=0)
    specs = [fit_to_context(spec, engine.max_model_len) for spec in sample]
    return run_level(config, specs, concurrency=level.concurrency, warmup=warmup).level


# Above this many users a level's median inter-token gap is no decode step: prefill-heavy steps are
# most of the steps and the API server's delivery jitter moves the median (the 14B's eager median
# at 128 users, 27 ms, is below its 8-user one).
DECODE_STEP_MAX_USERS = 64
# The per-step scheduling taken off a decode step before it is shared out per layer: what the
# CUDA-graph 1-user levels leave once the GPU's part is taken off (0.9-1.1 ms); ±0.5 ms moves a
# 32-layer figure by 16 µs.
DECODE_STEP_SCHEDULING_S = 1e-3


def mean_decode_context(mix) -> int:
    """A request's context at the middle of its decode: the mean prompt plus half the mean output."""
    total = sum(bucket.share for bucket in mix.buckets) or 1.0
    prompt = sum(bucket.share * sum(bucket.prompt_range) / 2 for bucket in mix.buckets) / total
    output = sum(bucket.share * sum(bucket.output_range) / 2 for bucket in mix.buckets) / total
    return round(prompt + output / 2)


def decode_step_evidence(item: dict, gpu) -> list[dict]:
    """Per recorded level (≤ DECODE_STEP_MAX_USERS users): the measured decode step and the host
    time per layer it implies, overlapped with the GPU's work and in series with it."""
    model = model_of(item)
    mix = load_mix(item["report"]["mix"])
    costs = StepCostModel(model, item["profile"], gpu)
    context = mean_decode_context(mix)
    rows = []
    for level in sorted(item["report"]["levels"], key=lambda lv: lv.get("concurrency") or 0):
        users, step_ms = level.get("concurrency"), level.get("median_itl_ms")
        if not users or users > DECODE_STEP_MAX_USERS or not step_ms:
            continue
        step = costs.step_time([ScheduledChunk(context, 1, True)] * users)
        gpu_ms = (step.gpu_s + step.launch_gap_s) * 1e3
        host_ms = step_ms - DECODE_STEP_SCHEDULING_S * 1e3
        rows.append(
            {
                "file": item["path"].name,
                "model": item["shape"],
                "mode": item["mode"],
                "users": users,
                "layers": model.num_layers,
                "step_ms": step_ms,
                "gpu_ms": gpu_ms,
                "overlapped_us_per_layer": host_ms / model.num_layers * 1e3,
                "serial_us_per_layer": (host_ms - gpu_ms) / model.num_layers * 1e3,
            }
        )
    return rows


def print_decode_steps(reports: list[dict], gpu) -> None:
    print(
        "| run | mode | users | layers | decode step ms (median ITL) | simulated GPU part ms "
        "| host µs/layer, overlapped | host µs/layer, in series |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for item in reports:
        for row in decode_step_evidence(item, gpu):
            print(
                f"| {short_name(row['file'])} | {row['mode']} | {row['users']} | {row['layers']} "
                f"| {row['step_ms']:.1f} | {row['gpu_ms']:.1f} | {row['overlapped_us_per_layer']:.0f} "
                f"| {row['serial_us_per_layer']:.0f} |"
            )


def short_name(file: str) -> str:
    return file.removesuffix(".json").replace("-chat-hf", "").replace("-instruct-v0.3", "")


RANGE_OF = {"tok_s": "output_throughput", "tpot_ms": "mean_tpot_ms", "ttft_ms": "mean_ttft_ms"}


def inside_mark(confidence: dict, metric: str, measured: float) -> str:
    """ " ✓" when the measured figure is inside the predicted range, " ✗" when not, " ∅" when the
    twin gave no number."""
    if confidence["outside"] or not confidence["range"] or metric not in confidence["range"]:
        return " ∅"
    low, high = confidence["range"][metric]
    return " ✓" if low <= measured <= high else " ✗"


def error(predicted: float | None, measured: float) -> float | None:
    return None if not predicted else (predicted / measured - 1) * 100


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(ROOT / "tests/sim/data/h200"))
    parser.add_argument("--fit-model", default="llama-2-7b-chat-hf", help="the shape the fit reports are of")
    parser.add_argument("--fit-levels", default="1,16")
    parser.add_argument("--fit-file-prefix", default="bench-", help="fit on reports whose names start so")
    parser.add_argument("--gpu", default="h200-sxm-141gb")
    parser.add_argument("--mode", choices=("eager", "graphs"), default=None, help="only this mode's reports")
    parser.add_argument("--json", default=None)
    parser.add_argument("--decode-steps", action="store_true", help="the decode-step evidence table only")
    options = parser.parse_args()
    gpu = get_gpu(options.gpu)
    fit_levels = [int(x) for x in options.fit_levels.split(",")]
    # Only bench reports: a data folder may also hold the run's other records (host-launch.json).
    paths = sorted(Path(options.data).glob("*.json"))
    reports = [load_report(path) for path in paths if "levels" in json.loads(path.read_text())]
    reports = [item for item in reports if options.mode in (None, item["mode"])]
    if options.decode_steps:
        print_decode_steps(reports, gpu)
        return 0

    calibrations, bases = {}, {}
    for item in reports:
        if item["shape"] != options.fit_model or not item["path"].name.startswith(options.fit_file_prefix):
            continue
        config = EngineConfig(model_of(item), item["profile"], gpu)
        levels = measured_levels(item["report"], only=fit_levels)
        started = time.monotonic()
        fit = fit_host_costs(config, load_mix(item["report"]["mix"]), levels)
        calibrations[item["mode"]] = fit.host
        bases[item["mode"]] = basis_of(
            gpu=options.gpu, eager=item["mode"] == "eager", layers=config.model.num_layers,
            mix=load_mix(item["report"]["mix"]), fit_levels=fit.levels,
        )  # fmt: skip
        print(
            f"{item['mode']}: fitted {describe_calibration(fit.host.as_dict())};"
            f" {fit.evaluations} runs, {time.monotonic() - started:.0f} s",
            file=sys.stderr,
        )

    rows = []
    for item in reports:
        model = model_of(item)
        mix = load_mix(item["report"]["mix"])
        for level in sorted(measured_levels(item["report"]), key=lambda lv: lv.concurrency):
            row = {
                "file": item["path"].name,
                "model": item["shape"],
                "mode": item["mode"],
                "users": level.concurrency,
                # The level's own figures: a report may repeat a concurrency (`repeat-*`).
                "measured": {
                    "tok_s": level.output_throughput,
                    "tpot_ms": level.mean_tpot_ms,
                    "ttft_ms": level.mean_ttft_ms,
                },
            }
            for label, host in (("uncal", DEFAULT_HOST_COSTS), ("cal", calibrations.get(item["mode"]))):
                if host is None:
                    continue
                result = simulate(EngineConfig(model, replace(item["profile"]), gpu, host=host), mix, level)
                row[label] = {
                    "tok_s": result["output_throughput"],
                    "tpot_ms": result["mean_tpot_ms"],
                    "ttft_ms": result["mean_ttft_ms"],
                }
                # How sure the twin says it is (inference.sim.confidence), and whether the measured
                # figure fell inside: the range's own check against held-out levels.
                prompt, output = mix_means(mix)
                question = Question(
                    gpu=options.gpu, eager=item["mode"] == "eager", layers=model.num_layers,
                    mean_prompt_tokens=prompt, mean_output_tokens=output, is_volta=gpu.is_volta,
                )  # fmt: skip
                confidence = judge(
                    result, basis=bases.get(item["mode"]), calibrated=label == "cal", question=question
                )
                row[label]["range"] = confidence.as_dict()
            rows.append(row)

    print(
        "| run | mode | users | tok/s meas. | uncal. | cal. | TPOT ms meas. | uncal. | cal. "
        "| TTFT ms meas. | uncal. | cal. |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        cells = [short_name(row["file"]), row["mode"], str(row["users"])]
        for key, digits in (("tok_s", 0), ("tpot_ms", 1), ("ttft_ms", 0)):
            measured = row["measured"][key]
            cells.append(f"{measured:.{digits}f}")
            for label in ("uncal", "cal"):
                if label not in row:
                    cells.append("–")
                    continue
                value = row[label][key]
                miss = error(value, measured)
                mark = inside_mark(row[label]["range"], RANGE_OF[key], measured)
                cells.append(f"{value:.{digits}f} ({miss:+.0f}%){mark}" if miss is not None else "–")
        print("| " + " | ".join(cells) + " |")
    print()
    for label in ("uncal", "cal"):
        marks = [
            inside_mark(row[label]["range"], RANGE_OF[key], row["measured"][key])
            for row in rows if label in row for key in RANGE_OF
        ]  # fmt: skip
        if marks:
            print(
                f"{label}: measured inside the range {marks.count(' ✓')} of {len(marks)}, outside it "
                f"{marks.count(' ✗')}, no number given {marks.count(' ∅')}"
            )
    if options.json:
        Path(options.json).write_text(
            json.dumps(
                {"calibration": {mode: host.as_dict() for mode, host in calibrations.items()}, "rows": rows},
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
