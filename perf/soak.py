"""The gateway soak: hundreds of concurrent streaming clients through the gateway to the V100 simulator.

    .venv/bin/python -m perf.soak --clients 200 --duration 180 [--warmup 30] [--direct-clients 20]
        [--quota-clients 2] [--mix field-mix] [--json soak.json]

A throwaway world on 127.0.0.1, in a temporary directory: a SQLite database
(migrated) and a private `redis-server` (the machine's PostgreSQL and Redis are
not touched); the simulator serving Llama-2-7B fp16 TP8 on simulated
V100-SXM2-32GB with the profile of docs/v100-field-guide.md#launch-settings
(max_num_seqs 256, chunked prefill, prefix caching, eager), registered as an
adopted endpoint (`endpoint_register`,
what `manage.py register_endpoint` does); a team and key with every quota set
but too high to bind (so every check still runs); a second key of that team
with a deliberately low requests-per-minute quota; one gateway web process
(uvicorn, 1 worker, uvloop, httptools) and the usage flusher.

Load: `--clients` closed-loop users stream chat completions through the
gateway, each sending its next request when the last ends (prompt and output
lengths from `--mix`, output forced with `ignore_eos`), ramped in over the first
half of the warm-up, then held for `--duration` seconds; requests running at
the end finish (each bounded by `--request-timeout`). Every stream is checked:
HTTP status, an error event, `[DONE]`, exactly `max_tokens` tokens.

Added latency: `--direct-clients` more users stream straight to the simulator
during the same run. Both groups share one engine batch, one machine and one
client event loop at the same instant, so the difference between them is what
the gateway path adds (its work, its wait for a core, one more hop), not the
machine's load drifting between phases, which on a shared host moves TTFT more
than the gateway does. Direct user i sends the same sequence of requests as
gateway user i (the simulator is deterministic), so "added, same requests"
compares like with like; "added, all" also differs by the lengths drawn.
Requests started during the warm-up are not measured.
TTFT is also split at the gateway's long-prompt threshold: long prompts wait
at the gateway while two others are in prefill (its limiter, by design).

Memory: the gateway process's RSS (/proc) every `--sample-interval` seconds;
start (after the warm-up), end, max, growth, and the slope over the second
half of the hold (warm-up growth flattens there; a leak does not).

Errors by kind; 429s of the low-quota key are quota-intended and counted
apart; every other error, and a usage record missing for a request, fails
the run (exit code 1).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from devtools import free_port, wait_for_http
from inference.loadgen.summary import RequestRecord, percentile
from perf._common import flusher_loop, start, table, tear_down
from perf._world import adopted_endpoint, log_file, start_private_redis, use_throwaway_portal

MODEL = "llama-2-7b-chat-hf"
HARDWARE = "v100-sxm2-32gb"
PROMPT_POOL = 512  # distinct requests the users cycle through
CHAT_FRAMING_TOKENS = 16  # the simulator's "user: " and per-message tokens, with room to spare
CONFIG_KEYS = ("clients", "direct_clients", "quota_clients", "duration", "warmup", "mix", "hardware",
               "quota_rpm", "request_timeout")  # fmt: skip
HIGH = {"rpm_limit": 10**7, "tpm_limit": 10**9, "tokens_per_day": 10**12, "max_concurrent": 10_000}


def profile():
    """The 7B fp16 / TP8 / 8 × V100-SXM2-32GB profile of docs/v100-field-guide.md#launch-settings
    (the demo's `v100-7b-fp16-tp8`)."""
    from inference.profile import ProfileSettings

    return ProfileSettings(
        dtype="float16", tensor_parallel_size=8, max_model_len=4096, gpu_memory_utilization=0.93,
        max_num_seqs=256, block_size=16, enable_prefix_caching=True, enable_chunked_prefill=True,
        enforce_eager=True,
    )  # fmt: skip


# --- the world ------------------------------------------------------------------------------------------


@dataclass
class World:
    gateway: str = ""
    sim: str = ""
    token: str = ""
    quota_token: str = ""
    gateway_pid: int = 0
    sim_pid: int = 0
    processes: list[subprocess.Popen] = field(default_factory=list)


def build_world(world: World, directory: Path, args) -> None:
    """Redis, the simulator, the database, keys, the gateway and the flusher; processes go in
    `world.processes` as they start, so the caller stops whatever did start."""
    from inference.vllm_args import SIM_MODULE, LaunchSettings, ServerArgs, vllm_args

    sim_port, gateway_port = free_port(), free_port()
    redis_url = start_private_redis(directory, world.processes)
    use_throwaway_portal(directory, redis_url, label="soak")

    server = ServerArgs(model_path=MODEL, served_model_name=MODEL, host="127.0.0.1", port=sim_port)
    sim = start(
        ["-m", SIM_MODULE, *vllm_args(LaunchSettings(profile()), server), "--hardware", args.hardware],
        stdout=log_file(directory, "sim"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    world.processes.append(sim)
    world.sim, world.sim_pid = f"http://127.0.0.1:{sim_port}", sim.pid
    wait_for_http(f"{world.sim}/health", watch=sim, timeout_s=60)

    world.token, world.quota_token = setup_portal(world.sim, quota_rpm=args.quota_rpm)

    gateway = start(
        ["-m", "uvicorn", "portal.asgi:application", "--host", "127.0.0.1", "--port", str(gateway_port),
         "--workers", "1", "--loop", "uvloop", "--http", "httptools", "--no-access-log",
         "--log-level", "warning"],
        stdout=log_file(directory, "gateway"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    world.processes.append(gateway)
    world.gateway, world.gateway_pid = f"http://127.0.0.1:{gateway_port}", gateway.pid
    world.processes.append(
        start(["-m", "perf.soak", "--flusher"], stdout=log_file(directory, "flusher"),
              stderr=subprocess.STDOUT)
    )  # fmt: skip
    wait_for_http(f"{world.gateway}/v1/models", watch=gateway, timeout_s=60)


def setup_portal(sim_url: str, *, quota_rpm: int) -> tuple[str, str]:
    """The simulator as the model's adopted endpoint; the two keys."""
    team, _deployment = adopted_endpoint(
        upstream=sim_url, model=MODEL, config=MODEL, name="soak-sim",
        team={"name": "Soak", "slug": "soak", **HIGH},
    )  # fmt: skip
    # Imported once adopted_endpoint has set Django up.
    from portal.teams.services import api_key_create

    _key, token = api_key_create(team=team, name="soak", allowed_models=[MODEL], **HIGH)
    _key, quota_token = api_key_create(
        team=team, name="soak low quota", allowed_models=[MODEL], rpm_limit=quota_rpm
    )
    return token, quota_token


# --- the load -------------------------------------------------------------------------------------------


@dataclass
class Result:
    """One soak request: who sent it, and what the one streaming client recorded (`RequestRecord`)."""

    group: str  # gateway, direct, quota
    started: float  # seconds since the load began
    record: RequestRecord
    long_prompt: bool = False  # over the gateway's long-prompt threshold (its limiter applies)
    user: int = 0  # which user of its group sent it


def prompt_pool(
    mix_name: str, *, seed: int, max_model_len: int, long_prompt_tokens: int
) -> list[tuple[int, bool, bytes]]:
    """(forced output tokens, long prompt?, encoded request body) for PROMPT_POOL draws of the mix;
    a prompt is long as the gateway counts it (`portal.gateway.tokens`, no tokenizer here)."""
    from inference.loadgen.prompts import EstimatingPromptBuilder
    from inference.loadgen.workloads import fit_to_context, load_mix
    from portal.gateway.tokens import prompt_tokens

    # The simulator counts 4 characters per token without a tokenizer; so does this builder.
    builder = EstimatingPromptBuilder()
    pool = []
    for index, spec in enumerate(load_mix(mix_name, allow_files=True).sample(PROMPT_POOL, seed=seed)):
        spec = fit_to_context(spec, max_model_len - CHAT_FRAMING_TOKENS)
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": builder.build(spec, seed=seed * PROMPT_POOL + index)}],
            "max_tokens": spec.output_tokens,
            "ignore_eos": True,
            "temperature": 0.0,
            "stream": True,
        }
        long = prompt_tokens(body, chat=True, tokenizer_path=None) > long_prompt_tokens
        pool.append((spec.output_tokens, long, json.dumps(body).encode()))
    return pool


@dataclass
class Sample:
    t: float
    rss_mb: float
    cpu_s: float  # the gateway's user + system CPU seconds so far
    sim_cpu_s: float
    in_flight: dict[str, int]
    running: float | None
    waiting: float | None
    preemptions: float | None


def _rss_mb(pid: int) -> float:
    """Resident set size (VmRSS) of one process, in MB (10^6 bytes)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024 / 1e6
    return float("nan")


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def run_load(world: World, args, pool: list[tuple[int, bool, bytes]]) -> dict:
    import aiohttp

    from inference.loadgen.client import RequestInput, stream_request
    from inference.loadgen.loadgen import SelfWatch
    from inference.vllm_metrics import parse_vllm_metrics

    results: list[Result] = []
    samples: list[Sample] = []
    in_flight: Counter[str] = Counter()
    groups = {
        "gateway": (args.clients, world.gateway, {"Authorization": f"Bearer {world.token}"}),
        "direct": (args.direct_clients, world.sim, {}),
        "quota": (args.quota_clients, world.gateway, {"Authorization": f"Bearer {world.quota_token}"}),
    }
    ramp_s = args.warmup / 2
    began = time.perf_counter()
    warm_at, stop_at = began + args.warmup, began + args.warmup + args.duration
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None)

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def user(group: str, index: int, count: int, root: str, headers: dict) -> None:
            await asyncio.sleep(ramp_s * index / max(1, count))
            # Direct user i walks the same requests as gateway user i (a paired comparison).
            walk = f"quota-{index}" if group == "quota" else str(index)
            rng = random.Random(f"{walk}-{args.seed}")  # noqa: S311 (a reproducible walk, not security)
            url = f"{root}/v1/chat/completions"
            while time.perf_counter() < stop_at:
                expected, long_prompt, body = pool[rng.randrange(len(pool))]
                request = RequestInput(
                    url, body, headers, timeout_s=args.request_timeout, expected_output_tokens=expected
                )
                started = time.perf_counter() - began
                in_flight[group] += 1
                try:
                    record = await stream_request(session, request)
                finally:
                    in_flight[group] -= 1
                results.append(Result(group, started, record, long_prompt=long_prompt, user=index))
                if record.error:
                    # A quota refusal, or a failing path: do not hot-loop on it.
                    await asyncio.sleep(args.quota_backoff if group == "quota" else 0.5)

        async def sampler() -> None:
            metrics_url = f"{world.sim}/metrics"
            while True:
                running = waiting = preemptions = None
                with contextlib.suppress(aiohttp.ClientError, TimeoutError, OSError):
                    async with session.get(metrics_url, timeout=aiohttp.ClientTimeout(total=5)) as response:
                        metrics = parse_vllm_metrics(await response.text())
                        running, waiting, preemptions = metrics.running, metrics.waiting, metrics.preemptions
                samples.append(
                    Sample(time.perf_counter() - began, _rss_mb(world.gateway_pid), _cpu_s(world.gateway_pid),
                           _cpu_s(world.sim_pid), dict(in_flight), running, waiting, preemptions)
                )  # fmt: skip
                await asyncio.sleep(args.sample_interval)

        idle_rss = _rss_mb(world.gateway_pid)
        watch = SelfWatch()
        background = [asyncio.create_task(sampler())]
        users = [
            asyncio.create_task(user(group, i, count, root, headers))
            for group, (count, root, headers) in groups.items()
            for i in range(count)
        ]

        async def self_watch() -> None:
            await asyncio.sleep(max(0.0, warm_at - time.perf_counter()))
            watch.start()
            await watch.probe()

        background.append(asyncio.create_task(self_watch()))
        await asyncio.sleep(max(0.0, stop_at - time.perf_counter()))
        client = watch.summary() if hasattr(watch, "wall0") else {}
        await asyncio.gather(*users)
        drained_at = time.perf_counter() - began
        for task in background:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*background)
        # After the drain: what the process keeps once the streams are gone.
        await asyncio.sleep(min(2.0, args.sample_interval))
        after_rss = _rss_mb(world.gateway_pid)
    return {
        "results": results,
        "samples": samples,
        "warm_s": args.warmup,
        "stop_s": args.warmup + args.duration,
        "drained_s": drained_at,
        "idle_rss_mb": idle_rss,
        "after_drain_rss_mb": after_rss,
        "client": client,
    }


# --- the report -----------------------------------------------------------------------------------------


def usage_check(expected: int, wait_s: float = 15) -> int:
    """Usage rows once the queue is flushed; waits for the gateway to finish the last ones."""
    from portal.teams.models import Usage
    from portal.teams.services import usage_flush

    deadline = time.monotonic() + wait_s
    while True:
        with contextlib.suppress(Exception):  # SQLite busy while the flusher writes: try again
            usage_flush()
        count = Usage.objects.count()
        if count >= expected or time.monotonic() > deadline:
            return count
        time.sleep(0.5)


def _pct(values: list[float], q: float) -> float | None:
    return percentile(values, q) if values else None


def _slope_mb_per_min(points: list[tuple[float, float]]) -> float | None:
    if len(points) < 3:
        return None
    ts, ys = [p[0] for p in points], [p[1] for p in points]
    mean_t, mean_y = statistics.fmean(ts), statistics.fmean(ys)
    var = sum((t - mean_t) ** 2 for t in ts)
    if var == 0:
        return None
    return sum((t - mean_t) * (y - mean_y) for t, y in zip(ts, ys, strict=True)) / var * 60


def summarize(load: dict, args, usage_rows: int | None) -> dict:
    results: list[Result] = load["results"]
    warm, stop_s = load["warm_s"], load["stop_s"]
    paths = {}
    # "paired": the gateway users that walk the same requests as the direct ones.
    for group, users in (("direct", None), ("gateway", None), ("paired", args.direct_clients)):
        measured = [
            r.record
            for r in results
            if r.group == ("direct" if group == "direct" else "gateway") and warm <= r.started < stop_s
            and r.record.ok and (users is None or r.user < users)
        ]  # fmt: skip
        ttft = [r.ttft for r in measured]
        total = [r.e2el for r in measured]
        tpot = [t for r in measured if (t := r.tpot) is not None]
        paths[group] = {
            "clients": args.clients if group == "gateway" else args.direct_clients,
            "requests": len(measured),
            "tokens_s": sum(r.output_tokens for r in measured) / args.duration,
            "ttft_p50_ms": _ms(_pct(ttft, 50)),
            "ttft_p99_ms": _ms(_pct(ttft, 99)),
            "total_p50_s": _pct(total, 50),
            "total_p99_s": _pct(total, 99),
            "tpot_p50_ms": _ms(_pct(tpot, 50)),
            "tpot_p99_ms": _ms(_pct(tpot, 99)),
        }
    metrics = ("ttft_p50_ms", "ttft_p99_ms", "total_p50_s", "total_p99_s", "tpot_p50_ms", "tpot_p99_ms")
    # The headline: the same requests at the same time, gateway − direct; and all gateway users − direct.
    added = {name: _minus(paths["paired"][name], paths["direct"][name]) for name in metrics}
    added_all = {name: _minus(paths["gateway"][name], paths["direct"][name]) for name in metrics}
    # TTFT split by prompt length: the gateway holds long prompts back while two others are in
    # prefill (its long-prompt limiter, by design), which direct requests never wait for.
    by_prompt: dict = {}
    for kind, long in (("short", False), ("long", True)):
        row: dict = {}
        for group in ("direct", "gateway"):
            ttft = [
                r.record.ttft
                for r in results
                if r.group == group and r.long_prompt == long and warm <= r.started < stop_s and r.record.ok
            ]
            row[group] = {"requests": len(ttft), "p50_ms": _ms(_pct(ttft, 50)), "p99_ms": _ms(_pct(ttft, 99))}
        row["added_p50_ms"] = _minus(row["gateway"]["p50_ms"], row["direct"]["p50_ms"])
        row["added_p99_ms"] = _minus(row["gateway"]["p99_ms"], row["direct"]["p99_ms"])
        by_prompt[kind] = row

    errors = Counter(f"{r.group}: {r.record.error_kind}" for r in results if not r.record.ok)
    intended = Counter(
        {kind: n for kind, n in errors.items() if kind.startswith("quota: HTTP 429")}
    )  # fmt: skip
    unintended = errors - intended
    gateway_requests = sum(1 for r in results if r.group in ("gateway", "quota"))
    if usage_rows is not None and usage_rows < gateway_requests:
        unintended["usage records missing (gateway requests without a row)"] = gateway_requests - usage_rows

    samples: list[Sample] = load["samples"]
    held = [s for s in samples if warm <= s.t <= stop_s]
    memory: dict = {
        "idle_mb": load["idle_rss_mb"],
        "after_drain_mb": load["after_drain_rss_mb"],
        "samples": len(held),
    }
    if held:
        start_mb, end_mb = held[0].rss_mb, held[-1].rss_mb
        second_half = [(s.t, s.rss_mb) for s in held if s.t >= warm + args.duration / 2]
        memory.update(
            start_mb=start_mb,
            end_mb=end_mb,
            max_mb=max(s.rss_mb for s in held),
            growth_mb=end_mb - start_mb,
            growth_pct=(end_mb - start_mb) / start_mb * 100,
            slope_last_half_mb_min=_slope_mb_per_min(second_half),
        )
    engine: dict = {}
    if len(held) >= 2:
        wall = held[-1].t - held[0].t
        engine["gateway_cpu_share"] = (held[-1].cpu_s - held[0].cpu_s) / wall if wall else None
        engine["sim_cpu_share"] = (held[-1].sim_cpu_s - held[0].sim_cpu_s) / wall if wall else None
    if held:
        running = [s.running for s in held if s.running is not None]
        engine["running_min"] = min(running) if running else None
        engine["running_max"] = max(running) if running else None
        engine["waiting_max"] = max((s.waiting for s in held if s.waiting is not None), default=None)
        engine["gateway_streams_min"] = min(s.in_flight.get("gateway", 0) for s in held)
        engine["gateway_streams_mean"] = statistics.fmean(s.in_flight.get("gateway", 0) for s in held)
        first_p, last_p = held[0].preemptions, held[-1].preemptions
        engine["preemptions"] = last_p - first_p if first_p is not None and last_p is not None else None
    return {
        "config": {name: getattr(args, name) for name in CONFIG_KEYS},
        "paths": paths,
        "added": added,
        "added_all": added_all,
        "ttft_by_prompt": by_prompt,
        "long_prompt_tokens": args.long_prompt_tokens,
        "errors": {
            "not_intended": dict(unintended),
            "quota_intended": dict(intended),
            "not_intended_total": sum(unintended.values()),
            "quota_intended_total": sum(intended.values()),
        },
        "requests": {
            group: sum(1 for r in results if r.group == group) for group in ("gateway", "direct", "quota")
        },
        "usage_rows": usage_rows,
        "memory": memory,
        "engine": engine,
        "client": load["client"],
        "drained_s": load["drained_s"],
        "load_average": os.getloadavg(),
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


def _minus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def _f(value: float | None, spec: str, signed: bool = False) -> str:
    if value is None:
        return "–"
    return format(value, ("+" if signed else "") + spec)


def print_report(summary: dict) -> None:
    c, paths, added = summary["config"], summary["paths"], summary["added"]
    print()
    print(
        f"Soak: {c['clients']} streaming clients through the gateway + {c['direct_clients']} direct to the "
        f"simulator at the same time, {c['duration']:g} s measured after a {c['warmup']:g} s warm-up; "
        f"mix {c['mix']}; Llama-2-7B fp16 TP8 on simulated {c['hardware']} (max_num_seqs 256); "
        "one gateway process (uvicorn, uvloop, httptools; auth + quotas + usage on)"
    )
    rows = []
    labels = {"direct": "direct", "paired": "gateway, same requests", "gateway": "gateway, all"}
    for name, label in labels.items():
        p = paths[name]
        rows.append(
            [label, str(p["clients"]), str(p["requests"]), f"{p['tokens_s']:.0f}",
             _f(p["ttft_p50_ms"], ".1f"), _f(p["ttft_p99_ms"], ".1f"), _f(p["total_p50_s"], ".2f"),
             _f(p["total_p99_s"], ".2f"), _f(p["tpot_p50_ms"], ".1f"), _f(p["tpot_p99_ms"], ".1f")]
        )  # fmt: skip
    for label, diff in (("added, same requests", added), ("added, all", summary["added_all"])):
        rows.append(
            [label, "", "", "", _f(diff["ttft_p50_ms"], ".1f", True), _f(diff["ttft_p99_ms"], ".1f", True),
             _f(diff["total_p50_s"], ".2f", True), _f(diff["total_p99_s"], ".2f", True),
             _f(diff["tpot_p50_ms"], ".1f", True), _f(diff["tpot_p99_ms"], ".1f", True)]
        )  # fmt: skip
    header = ["path", "clients", "requests", "tok/s", "TTFT P50 ms", "TTFT P99 ms", "total P50 s",
              "total P99 s", "TPOT P50 ms", "TPOT P99 ms"]  # fmt: skip
    print(table(header, rows))
    print(
        "(same requests: gateway user i sends what direct user i sends, at the same time; added: gateway − "
        "direct, over requests started after the warm-up; `all` also differs by the lengths drawn)"
    )

    print()
    rows = []
    for kind, row in summary["ttft_by_prompt"].items():
        d, g = row["direct"], row["gateway"]
        label = f"{'≤' if kind == 'short' else '>'} {summary['long_prompt_tokens']} ({kind})"
        rows.append(
            [label, str(d["requests"]), _f(d["p50_ms"], ".1f"), _f(d["p99_ms"], ".1f"), str(g["requests"]),
             _f(g["p50_ms"], ".1f"), _f(g["p99_ms"], ".1f"), _f(row["added_p50_ms"], ".1f", True),
             _f(row["added_p99_ms"], ".1f", True)]
        )  # fmt: skip
    header = ["TTFT by prompt tokens", "direct n", "P50 ms", "P99 ms", "gateway n", "P50 ms", "P99 ms",
              "added P50", "added P99"]  # fmt: skip
    print(table(header, rows))
    print("(long prompts wait at the gateway while two others are in prefill: its limiter, by design)")

    m, e, client = summary["memory"], summary["engine"], summary["client"]
    print()
    mem_rows = [
        ["idle, before the load", _f(m.get("idle_mb"), ".1f")],
        ["start (after the warm-up)", _f(m.get("start_mb"), ".1f")],
        ["end", _f(m.get("end_mb"), ".1f")],
        ["max", _f(m.get("max_mb"), ".1f")],
        ["growth", f"{_f(m.get('growth_mb'), '.1f', True)} ({_f(m.get('growth_pct'), '.1f', True)} %)"],
        ["slope over the last half, MB/min", _f(m.get("slope_last_half_mb_min"), ".2f", True)],
        ["after the drain", _f(m.get("after_drain_mb"), ".1f")],
    ]
    print(table([f"gateway RSS ({m['samples']} samples)", "MB"], mem_rows))

    print()
    err = summary["errors"]
    error_rows = [[kind, str(n)] for kind, n in sorted(err["not_intended"].items())]
    error_rows += [[f"{kind} (quota-intended)", str(n)] for kind, n in sorted(err["quota_intended"].items())]
    error_rows.append(["not intended, total", str(err["not_intended_total"])])
    error_rows.append(["quota-intended, total", str(err["quota_intended_total"])])
    print(table(["errors", "count"], error_rows))

    print()
    requests = summary["requests"]
    usage = summary["usage_rows"]
    gateway_total = requests["gateway"] + requests["quota"]
    lag = client.get("loop_lag_p95_ms")
    other_rows = [
        ["requests sent: gateway / direct / low-quota key",
         f"{requests['gateway']} / {requests['direct']} / {requests['quota']}"],
        ["usage records for gateway requests", f"{usage if usage is not None else '–'} of {gateway_total}"],
        ["gateway streams in flight (min / mean)",
         f"{_f(e.get('gateway_streams_min'), '.0f')} / {_f(e.get('gateway_streams_mean'), '.1f')}"],
        ["engine running (min / max), waiting max",
         f"{_f(e.get('running_min'), '.0f')} / {_f(e.get('running_max'), '.0f')}, "
         f"{_f(e.get('waiting_max'), '.0f')}"],
        ["engine preemptions", _f(e.get("preemptions"), ".0f")],
        ["CPU, share of a core: gateway / simulator / this client",
         f"{_f(e.get('gateway_cpu_share'), '.2f')} / {_f(e.get('sim_cpu_share'), '.2f')} / "
         f"{_f(client.get('client_cpu_share'), '.2f')}"],
        ["client event-loop lag P95, ms", _f(lag, ".1f")],
        ["drained at, s (clients finishing their last request)", f"{summary['drained_s']:.1f}"],
        ["load average (1, 5, 15 min) at the end", ", ".join(f"{x:.2f}" for x in summary["load_average"])],
    ]  # fmt: skip
    print(table(["during the hold", ""], other_rows))
    if client.get("client_bound_reason"):
        print(f"WARNING: the load generator was the bottleneck ({client['client_bound_reason']})")
    elif client.get("host_note"):
        print(f"note: {client['host_note']}")


# --- main -----------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m perf.soak", description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=200, help="streaming users through the gateway")
    parser.add_argument(
        "--duration", type=float, default=180, help="seconds held and measured after the warm-up"
    )
    parser.add_argument("--warmup", type=float, default=None, help="seconds (default: min(30, duration / 4))")
    parser.add_argument("--direct-clients", type=int, default=None, help="users straight to the simulator "
                        "at the same time (default: clients / 10, at least 2)")  # fmt: skip
    parser.add_argument("--quota-clients", type=int, default=2, help="users of the low-quota key")
    parser.add_argument("--quota-rpm", type=int, default=2, help="the low-quota key's requests per minute")
    parser.add_argument("--quota-backoff", type=float, default=1.0, help="seconds a refused quota user waits")
    parser.add_argument("--mix", default="field-mix", help="workload mix (inference.loadgen.workloads)")
    parser.add_argument("--hardware", default=HARDWARE, help="simulated GPU (catalog key)")
    parser.add_argument("--request-timeout", type=float, default=120, help="client timeout per request, s")
    parser.add_argument("--sample-interval", type=float, default=None, help="RSS sampling, s (default ≤ 5)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="also write the summary as JSON here (- for stdout)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory (logs, database)")
    parser.add_argument("--flusher", action="store_true", help=argparse.SUPPRESS)
    parser.set_defaults(long_prompt_tokens=None)  # the gateway's setting, read once Django is set up
    args = parser.parse_args(argv)
    if args.warmup is None:
        args.warmup = min(30.0, args.duration / 4)
    if args.direct_clients is None:
        args.direct_clients = max(2, args.clients // 10)
    if args.sample_interval is None:
        args.sample_interval = min(5.0, max(0.25, args.duration / 20))
    if args.clients < 1 or args.direct_clients < 1 or args.duration <= 0:
        parser.error("--clients and --direct-clients must be ≥ 1 and --duration > 0")
    return args


def _terminate(signum, _frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.flusher:
        flusher_loop()
        return 0
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    signal.signal(signal.SIGTERM, _terminate)  # stop the children on SIGTERM too, not only Ctrl-C
    directory = Path(tempfile.mkdtemp(prefix="soak-"))
    world = World()
    try:
        print(f"soak: setting up in {directory}", flush=True)
        build_world(world, directory, args)
        from django.conf import settings

        pool = prompt_pool(
            args.mix,
            seed=args.seed,
            max_model_len=profile().max_model_len,
            long_prompt_tokens=settings.GATEWAY_LONG_PROMPT_TOKENS,
        )
        args.long_prompt_tokens = settings.GATEWAY_LONG_PROMPT_TOKENS
        print(
            f"soak: gateway {world.gateway}, simulator {world.sim}; {args.clients} + {args.direct_clients} "
            f"direct + {args.quota_clients} low-quota clients for {args.warmup:g} + {args.duration:g} s",
            flush=True,
        )
        load = asyncio.run(run_load(world, args, pool))
        gateway_requests = sum(1 for r in load["results"] if r.group in ("gateway", "quota"))
        usage_rows = usage_check(gateway_requests)
        summary = summarize(load, args, usage_rows)
        print_report(summary)
        if args.json:
            text = json.dumps(summary, indent=2, default=str)
            if args.json == "-":
                print(text)
            else:
                Path(args.json).write_text(text + "\n")
        return 1 if summary["errors"]["not_intended_total"] else 0
    except KeyboardInterrupt:
        print("soak: interrupted; stopping everything", file=sys.stderr)
        return 130
    finally:
        tear_down(world.processes, directory, keep=args.keep, label="soak")


if __name__ == "__main__":
    sys.exit(main())
