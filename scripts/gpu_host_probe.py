"""Where an eager step's host time goes, and a loaded level's TTFT, on a real GPU (issue 40).

Runs engines one after another on the borrowed GPU machine (vLLM shipped as
`../shared/gpu/README.md` says), each with `scripts/step_timer` on its `PYTHONPATH`, so every
call of the scheduler, the model runner, the model's forward and the API server's output
processing is timed (`scripts/step_timer/sitecustomize.py`). Around each level vLLM's own
`/metrics` histograms (queue time, prefill time, KV-cache use, preemptions) are read. Writes,
as it goes, into `--out`:

- `bench-<shape>-<mode>.json`: the levels in `manage.py bench --json`'s format (what
  `perf/sim_twin_errors.py` and `manage.py simulate --calibrate-from` read); a first warm-up
  level of every engine is measured and left out of it (the first level runs slow, docs/gpu-runs.md);
- `probe.json`: per level, the engine's step parts (medians over decode-only steps) and the
  metrics' deltas;
- `steps/<shape>-<mode>/<pid>.tsv`: the raw timings, `server-<shape>-<mode>.log`: the server's log.

    python3 scripts/gpu_host_probe.py --out /tmp/m [--plan default|pinning|plan.json]

Weights are vLLM's own random ones (`--load-format dummy`): only the config and a small
trained tokenizer are written, so a 24B engine starts without writing 47 GB first.
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import json
import os
import statistics
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

import gpu_run  # noqa: E402

from inference import server_log, supervisor  # noqa: E402
from inference.vllm_args import LaunchSettings, ServerArgs, command_line, vllm_args, vllm_command  # noqa: E402

TIMER = REPO / "scripts" / "step_timer"

# shape, mode, levels as (mix, users, measured requests); the first level of each engine is its warm-up.
DEFAULT_PLAN: list[dict] = [
    {"shape": "llama-2-7b-chat-hf", "mode": "eager",
     "levels": [["short-qa", 4, 8], ["short-qa", 1, 4], ["short-qa", 16, 48], ["fixed:128:256", 8, 16]]},
    {"shape": "mistral-small-24b-instruct-2501", "mode": "eager",
     "levels": [["short-qa", 4, 8], ["qa-summary-60-40", 8, 16], ["qa-summary-60-40", 16, 32],
                ["qa-summary-60-40", 32, 64], ["qa-summary-60-40", 96, 96], ["fixed:128:256", 8, 16]]},
    {"shape": "mistral-small-24b-instruct-2501", "mode": "graphs",
     "levels": [["short-qa", 4, 8], ["qa-summary-60-40", 8, 16], ["qa-summary-60-40", 16, 32],
                ["qa-summary-60-40", 32, 64], ["qa-summary-60-40", 96, 96]]},
    {"shape": "llama-2-7b-chat-hf", "mode": "graphs",
     "levels": [["short-qa", 4, 8], ["short-qa", 1, 4], ["short-qa", 16, 48]]},
]  # fmt: skip

# Does the host's speed of the minute come from where the OS runs vLLM's threads? Each eager engine
# runs the same level unpinned and pinned in turn (a level's 4th item `true`: `pin` below), so the
# two placements alternate within minutes of each other on one host; the 7B then runs 32 and 64
# users of the same fixed workload each way, whose prefill steps (a burst of prompts sent together)
# the raw step timings keep.
_PAIR = [["fixed:128:256", 8, 32], ["fixed:128:256", 8, 32, True]]
PINNING_PLAN: list[dict] = [
    {"shape": "llama-2-7b-chat-hf", "mode": "eager",
     "levels": [["fixed:128:256", 8, 16], *_PAIR * 4,
                ["fixed:128:256", 32, 64], ["fixed:128:256", 32, 64, True],
                ["fixed:128:256", 64, 128], ["fixed:128:256", 64, 128, True]]},
    {"shape": "mistral-small-24b-instruct-2501", "mode": "eager",
     "levels": [["fixed:128:256", 8, 16], *_PAIR * 3]},
]  # fmt: skip
PLANS = {"default": DEFAULT_PLAN, "pinning": PINNING_PLAN}

METRICS = (
    "vllm:request_queue_time_seconds",
    "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds",
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:num_preemptions",
    "vllm:prompt_tokens",
    "vllm:generation_tokens",
)


def log(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


def scrape(base: str) -> dict[str, float]:
    """Sums and counts of vLLM's histograms and counters, and the gauges (KV use, running, waiting)."""
    text = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()  # noqa: S310 - localhost
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:") or "_bucket" in line:
            continue
        name, _, value = line.rpartition(" ")
        key = name.split("{")[0]
        try:
            values[key] = values.get(key, 0.0) + float(value)
        except ValueError:
            continue
    return values


def metric_deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    out: dict[str, float] = {}
    for name in METRICS:
        total = after.get(name + "_sum", after.get(name + "_total", 0.0)) - before.get(
            name + "_sum", before.get(name + "_total", 0.0)
        )
        count = after.get(name + "_count", 0.0) - before.get(name + "_count", 0.0)
        out[name.removeprefix("vllm:")] = round(total / count * 1000, 2) if count else round(total, 2)
    return out


def read_parts(directory: Path, began: float, ended: float) -> list[tuple[str, float, float, int, int, int]]:
    """Timed calls inside [began, ended]: (part, start, duration, requests, tokens, pid)."""
    rows = []
    for path in directory.glob("*.tsv"):
        pid = int(path.stem)
        for line in path.read_text().splitlines():
            part, start, duration, requests, tokens = line.split("\t")
            if began <= float(start) <= ended:
                rows.append((part, float(start), float(duration), int(requests), int(tokens), pid))
    rows.sort(key=lambda row: row[1])
    return rows


def step_parts(rows: list[tuple[str, float, float, int, int, int]]) -> dict:
    """Medians, ms, over decode-only steps (every scheduled request one token), by part."""
    executes = [row for row in rows if row[0] == "execute_model" and row[3] > 0]
    decode_windows = [(row[1], row[1] + row[2], row[3]) for row in executes if row[4] == row[3]]
    parts: dict[str, list[float]] = {}
    batch: list[int] = []
    for start, end, requests in decode_windows:
        batch.append(requests)
        parts.setdefault("execute_model", []).append(end - start)
        inside = [row for row in rows if row[0] == "forward" and start <= row[1] <= end]
        if inside:
            parts.setdefault("forward", []).append(inside[0][2])
            parts.setdefault("prepare", []).append(end - start - inside[0][2])
    for part in ("schedule", "update_from_output", "sample_tokens"):
        parts[part] = [row[2] for row in rows if row[0] == part and row[3] == row[4] and row[3] > 0] or [
            row[2] for row in rows if row[0] == part
        ]
    schedules = [row[1] for row in rows if row[0] == "schedule" and row[3] > 0]
    periods = [b - a for a, b in itertools.pairwise(schedules)]
    outputs = [row for row in rows if row[0] == "process_outputs" and row[3] > 0]
    summary = {part: round(statistics.median(values) * 1000, 3) for part, values in parts.items() if values}
    summary.update(
        steps=len(schedules),
        decode_steps=len(decode_windows),
        mean_decode_batch=round(statistics.fmean(batch), 2) if batch else 0,
        period=round(statistics.median(periods) * 1000, 3) if periods else None,
        process_outputs=round(statistics.median(row[2] for row in outputs) * 1000, 3) if outputs else None,
        process_outputs_per_output_us=(
            round(sum(row[2] for row in outputs) / sum(row[3] for row in outputs) * 1e6, 2)
            if outputs
            else None
        ),
        prefill_steps=len([row for row in executes if row[4] > row[3]]),
        prefill_execute_model=(
            round(statistics.median(row[2] for row in executes if row[4] > row[3]) * 1000, 3)
            if any(row[4] > row[3] for row in executes)
            else None
        ),
    )
    return summary


def prefill_steps(rows: list[tuple[str, float, float, int, int, int]]) -> list[list[float]]:
    """Every step that computed prompt tokens: [requests, tokens, period ms (its schedule to the
    next), execute_model ms (inputs + launches), sample_tokens ms (waits for the GPU)]."""
    schedules = [row[1] for row in rows if row[0] == "schedule" and row[3] > 0]  # rows are by start
    samples = [row for row in rows if row[0] == "sample_tokens"]
    sample_starts = [row[1] for row in samples]
    found = []
    for part, start, duration, requests, tokens, _pid in rows:
        if part != "execute_model" or tokens <= requests:
            continue
        scheduled = bisect.bisect_right(schedules, start)  # schedules[scheduled - 1] began this step
        period = None
        if 0 < scheduled < len(schedules):
            period = round((schedules[scheduled] - schedules[scheduled - 1]) * 1000, 2)
        waited = bisect.bisect_left(sample_starts, start + duration)
        sample = round(samples[waited][2] * 1000, 2) if waited < len(samples) else None
        found.append([requests, tokens, period, round(duration * 1000, 2), sample])
    return found


def launch_per_layer(directory: Path, layers: int, *, window_s: float = 10.0) -> dict:
    """The eager forward's launch time per layer over a whole engine's run (ms): its spread over
    single steps, and the medians of successive windows (how the host's speed moved)."""
    rows = read_parts(directory, 0.0, float("inf"))
    per_layer = [row[2] * 1000 / layers for row in rows if row[0] == "forward"]
    starts = [row[1] for row in rows if row[0] == "forward"]
    if len(per_layer) < 10:
        return {}
    deciles = statistics.quantiles(per_layer, n=10)
    windows: dict[int, list[float]] = {}
    for start, value in zip(starts, per_layer, strict=True):
        windows.setdefault(int((start - starts[0]) // window_s), []).append(value)
    return {
        "steps": len(per_layer),
        "mean": round(statistics.fmean(per_layer), 3),
        "p10": round(deciles[0], 3),
        "median": round(statistics.median(per_layer), 3),
        "p90": round(deciles[-1], 3),
        f"window_medians_{window_s:g}s": [
            round(statistics.median(values), 3) for _, values in sorted(windows.items()) if len(values) >= 20
        ],
    }


def _tasks(pid: int) -> list[int]:
    return [int(task) for task in os.listdir(f"/proc/{pid}/task")]


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
    return found


def _place(pid: int, cpus: set[int]) -> None:
    """Every thread of `pid` onto `cpus` (sched_setaffinity sets one thread at a time)."""
    for task in _tasks(pid):
        try:
            os.sched_setaffinity(task, cpus)
        except OSError:
            continue


def _cores() -> list[list[int]]:
    """The machine's CPUs grouped by physical core (SMT siblings together), from sysfs."""
    cores: dict[tuple[int, int], list[int]] = {}
    for cpu in sorted(os.sched_getaffinity(0) | set(range(os.cpu_count() or 1))):
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            key = (
                int((topology / "physical_package_id").read_text()),
                int((topology / "core_id").read_text()),
            )
        except (OSError, ValueError):
            key = (0, cpu)
        cores.setdefault(key, []).append(cpu)
    return [cores[key] for key in sorted(cores)]


def pin(api_pid: int) -> dict:
    """The engine core on physical cores 2-3, the API server on core 4, this process (the load
    generator) on the upper half of the cores, and never below core 5: nothing of one shares a
    core with the others."""
    cores = _cores()
    engine = {cpu for core in cores[2:4] for cpu in core}
    api = set(cores[4])
    client = {cpu for core in cores[max(5, len(cores) // 2) :] for cpu in core}
    for child in _children(api_pid):
        _place(child, engine)
    _place(api_pid, api)
    _place(os.getpid(), client)
    return {"engine": sorted(engine), "api": sorted(api), "client": sorted(client), "cores": len(cores)}


def unpin(api_pid: int) -> dict:
    every = set(range(os.cpu_count() or 1))
    for pid in (*_children(api_pid), api_pid, os.getpid()):
        _place(pid, every)
    return {}


def run_engine(engine: dict, out: Path, models: Path, probe: list[dict]) -> None:
    shape, mode = engine["shape"], engine["mode"]
    name = f"{shape}-{mode}"
    model_dir = models / shape
    gpu_run.write_random_model(shape, model_dir, weights=False)
    steps_dir = out / "steps" / name
    steps_dir.mkdir(parents=True, exist_ok=True)
    port = supervisor.find_free_port()
    args = vllm_args(
        LaunchSettings(gpu_run.profile_for(mode, 1)), ServerArgs(str(model_dir), shape, "127.0.0.1", port)
    )
    argv = [*vllm_command(sys.executable, args), "--load-format", "dummy"]
    env = {
        **os.environ,
        **gpu_run.VLLM_ENV,
        "STEP_TIMER_DIR": str(steps_dir),
        "PYTHONPATH": os.pathsep.join(
            filter(None, [str(TIMER), str(REPO), os.environ.get("PYTHONPATH", "")])
        ),
    }
    log(f"starting {name}: {command_line(argv)}")
    log_path = out / f"server-{name}.log"
    started = time.monotonic()
    launched = supervisor.launch(argv, log_path=log_path, cuda_visible_devices="0", env=env)
    base = f"http://127.0.0.1:{port}"
    report: dict = {"engine": {"shape": shape, "mode": mode, "argv": command_line(argv)}, "levels": []}
    try:
        supervisor.wait_until_ready(
            base, shape, deadline_s=480,
            alive=lambda: launched.process.poll() is None, returncode=launched.process.poll,
        )  # fmt: skip
        report["engine"]["ready_s"] = round(time.monotonic() - started, 1)
        supervisor.warm_up(base, shape)
        log(f"{name}: ready in {report['engine']['ready_s']} s")
        for index, (mix, users, requests, *pinned) in enumerate(engine["levels"]):
            placement = pin(launched.process.pid) if pinned and pinned[0] else unpin(launched.process.pid)
            before = scrape(base)
            began = time.time()
            level_report = gpu_run.bench(base, shape, model_dir, mix=mix, levels=[users], requests=[requests])
            ended = time.time()
            after = scrape(base)
            rows = read_parts(steps_dir, began, ended)
            level = level_report["levels"][0]
            entry = {
                "engine": name, "mix": mix, "users": users, "warm_up": index == 0, "cpus": placement,
                "seconds": round(ended - began, 1),
                "client": {key: level.get(key) for key in (
                    "output_tok_s", "mean_ttft_ms", "mean_tpot_ms", "median_itl_ms", "p95_ttft_ms")},
                "metrics": metric_deltas(before, after),
                "kv_cache_usage_at_end": after.get("vllm:kv_cache_usage_perc"),
                "steps": step_parts(rows),
                "prefill_steps": prefill_steps(rows),
                "began": began, "ended": ended,
            }  # fmt: skip
            probe.append(entry)
            (out / "probe.json").write_text(json.dumps(probe, indent=1))
            log(f"{name} {mix} x{users}: {json.dumps(entry)}")
            if index == 0:
                continue  # the warm-up level stays out of the bench report
            if not report.get("mix") or report["mix"] == mix:
                report.update({k: v for k, v in level_report.items() if k != "levels"})
                report["levels"].append(level)
                (out / f"bench-{name}.json").write_text(json.dumps(report, indent=2))
            else:
                other = out / f"bench-{name}-{mix.replace(':', '_')}.json"
                done = json.loads(other.read_text()) if other.exists() else {**level_report, "levels": []}
                done["levels"].append(level)
                done["engine"] = report["engine"]
                other.write_text(json.dumps(done, indent=2))
    except Exception as error:
        report["engine"]["error"] = f"{type(error).__name__}: {error}"
        log(f"{name} failed: {report['engine']['error']}\n{server_log.log_tail(log_path)}")
        (out / f"bench-{name}.json").write_text(json.dumps(report, indent=2))
    finally:
        supervisor.stop_group(launched.pgid, grace_s=20)
        log(f"{name}: stopped")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--models", default="/tmp/models")  # noqa: S108 - the GPU machine's scratch disk
    parser.add_argument("--plan", default="default", help=f"one of {', '.join(PLANS)}, or a JSON file")
    parser.add_argument(
        "--summarize", default="", help="only summarize OUT/steps/<shape>-eager/ for shape:layers,..."
    )
    options = parser.parse_args()
    out = Path(options.out)
    if options.summarize:
        summary = {}
        for item in options.summarize.split(","):
            shape, layers = item.split(":")
            summary[shape] = launch_per_layer(out / "steps" / f"{shape}-eager", int(layers))
        print(json.dumps(summary, indent=1))
        return
    out.mkdir(parents=True, exist_ok=True)
    plan = PLANS.get(options.plan) or json.loads(Path(options.plan).read_text())
    probe: list[dict] = []
    gpu_run.discover(out)  # which GPU and driver the numbers belong to
    for engine in plan:
        run_engine(engine, out, Path(options.models), probe)
    log("all engines done")
    (out / "DONE").write_text("done\n")


if __name__ == "__main__":
    main()
