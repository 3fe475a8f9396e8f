"""The gateway's own cost: what one gateway process adds to a streamed request, and where the time goes.

    .venv/bin/python -m perf.gateway_overhead [--levels 1,8,64] [--rounds 5] [--duration 3]
        [--chunks 32] [--interval-ms 5] [--step-requests 300] [--json out.json]

The world of perf/proxy_bench.py (a private Redis and SQLite database, the fake upstream
streaming `--chunks` chunks `--interval-ms` apart, a key with every quota on but too high
to bind, the usage flusher) and one gateway process (`uvicorn --workers 1`, uvloop and
httptools, as in production). Each round runs the same closed-loop load at each level of
concurrent streams directly against the upstream and through the gateway (the order
alternates), with the one client of proxy_bench; it prints, as medians over the rounds of
each round's gateway-minus-direct difference:

- the added P50 time to the first chunk and to the last chunk;
- the added time per relayed chunk: (added to last − added to first) ÷ (chunks − 1);
- throughput (requests/s) through the gateway ÷ direct;
- the CPU (cores busy) of the gateway, the upstream, Redis and the client;
- the floor: the same figures for perf/relay_floor.py, a relay on the same server stack and
  upstream client that does nothing else (no key, quota, Redis or usage), measured in the same
  rounds (the order of the targets turns round by round). The gateway's added time minus the
  floor's is the portal's own work; the floor is what one more Python process on the path
  costs on this machine;
- nginx: the same figures for perf/nginx_relay.py (one nginx worker relaying unbuffered), when
  an nginx binary is found: what one more hop costs on this machine whatever its language.

Then a second gateway process with the step timing on (portal/gateway/timing.py,
PORTAL_GATEWAY_STEP_TIMING) serves `--step-requests` streamed requests one at a time,
and the median time of each step of one request's path is printed in microseconds.
The measured gateway runs without that timing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

from devtools import stop
from perf._common import table
from perf.nginx_relay import nginx_binary, start_nginx
from perf.proxy_bench import World, closed_loop, measure, running_world, start_gateway, wait_gateway

STEPS = (
    "ASGI entry", "authentication", "parsing", "route", "counting", "admission", "request encoding",
    "upstream connect", "first byte (upstream's own time included)", "response start", "per-chunk relay",
    "accounting",
)  # fmt: skip


def run_rounds(world: World, args) -> dict[int, list[dict]]:
    """Per level, one {"direct": result, "gateway": result, <relay>: result...} per round (the order
    of the targets turns round by round)."""
    rounds: dict[int, list[dict]] = {level: [] for level in args.levels}
    targets = ("direct", "gateway-1", *world.relays)
    for target in targets:  # warm: connections, the key row and routes cached
        measure(world, target, 8, argparse.Namespace(**{**vars(args), "duration": 1.0}))
    for number in range(args.rounds):
        for level in args.levels:
            turn = (number + level) % len(targets)
            order = targets[turn:] + targets[:turn]
            results = {target: measure(world, target, level, args) for target in order}
            results["gateway"] = results.pop("gateway-1")
            rounds[level].append(results)
            direct, gateway = results["direct"], results["gateway"]
            relays = [(name, results[name]) for name in world.relays]
            print(
                f"  round {number + 1} {level:>3} streams: first chunk {direct['ttft_p50_ms']:.2f} → "
                f"{gateway['ttft_p50_ms']:.2f} ms"
                + "".join(f" ({name} {r['ttft_p50_ms']:.2f})" for name, r in relays)
                + f", last {direct['last_chunk_p50_ms']:.2f} → {gateway['last_chunk_p50_ms']:.2f} ms, "
                f"end {direct['end_p50_ms']:.2f} → {gateway['end_p50_ms']:.2f} ms, "
                f"{direct['req_s']:.0f} → {gateway['req_s']:.0f} req/s"
                + "".join(f" ({name} {r['req_s']:.0f})" for name, r in relays)
                + ", errors "
                + "/".join(str(results[t]["errors"]) for t in ("direct", "gateway", *world.relays)),
                flush=True,
            )
    return rounds


def summarize(rounds: list[dict], chunks: int, relays: tuple[str, ...] = ()) -> dict[str, float]:
    """Medians over rounds of each round's gateway − direct (or ÷ direct), the same for each relay
    in `relays` (keys prefixed with its name), and of the CPU figures."""

    def med(value, relay: str = "gateway") -> float:
        return statistics.median(value(r["direct"], r[relay]) for r in rounds)

    def first(direct: dict, relay: dict) -> float:
        return relay["ttft_p50_ms"] - direct["ttft_p50_ms"]

    def last(direct: dict, relay: dict) -> float:
        return relay["last_chunk_p50_ms"] - direct["last_chunk_p50_ms"]

    def end(direct: dict, relay: dict) -> float:
        return relay["end_p50_ms"] - direct["end_p50_ms"]

    def added(relay: str, prefix: str = "") -> dict[str, float]:
        return {
            f"{prefix}added_first_ms": med(first, relay),
            f"{prefix}added_last_ms": med(last, relay),
            f"{prefix}added_per_chunk_ms": med(lambda d, g: (last(d, g) - first(d, g)) / (chunks - 1), relay),
            f"{prefix}added_end_ms": med(end, relay),
            f"{prefix}added_tail_ms": med(lambda d, g: end(d, g) - last(d, g), relay),
            f"{prefix}added_end_per_chunk_ms": med(
                lambda d, g: (end(d, g) - first(d, g)) / (chunks - 1), relay
            ),
            f"{prefix}throughput_ratio": med(lambda d, g: g["req_s"] / d["req_s"], relay),
        }

    summary = added("gateway")
    for relay in relays:
        summary |= added(relay, f"{relay}_")
        summary[f"{relay}_cpu_ms_per_request"] = med(lambda d, f: f["server_cpu"] / f["req_s"] * 1000, relay)
    return summary | {
        "direct_first_ms": med(lambda d, g: d["ttft_p50_ms"]),
        "direct_last_ms": med(lambda d, g: d["last_chunk_p50_ms"]),
        "direct_end_ms": med(lambda d, g: d["end_p50_ms"]),
        "direct_req_s": med(lambda d, g: d["req_s"]),
        "gateway_req_s": med(lambda d, g: g["req_s"]),
        "gateway_cpu": med(lambda d, g: g["server_cpu"]),
        "gateway_cpu_ms_per_request": med(lambda d, g: g["server_cpu"] / g["req_s"] * 1000),
        "upstream_cpu_direct": med(lambda d, g: d["upstream_cpu"]),
        "upstream_cpu_gateway": med(lambda d, g: g["upstream_cpu"]),
        "redis_cpu": med(lambda d, g: g["redis_cpu"]),
        "client_cpu_direct": med(lambda d, g: d["client_cpu"]),
        "client_cpu_gateway": med(lambda d, g: g["client_cpu"]),
        "errors": sum(r[target]["errors"] for r in rounds for target in ("direct", "gateway", *relays)),
    }


def start_relays(world: World, directory: Path) -> None:
    """perf/relay_floor.py in front of the same upstream, on the gateway's server stack, and nginx
    (perf/nginx_relay.py) when this machine has it."""
    url, process = start_gateway(
        world, directory, 1, "floor", {"PERF_FLOOR_UPSTREAM": world.upstream}, app="perf.relay_floor:app"
    )
    wait_gateway(directory, "floor", url, process)
    world.relays["floor"] = (url, process)
    binary = nginx_binary()
    if binary is None:
        print("  nginx not found (PERF_NGINX, PATH, /usr/sbin/nginx): its rows are left out", flush=True)
        return
    world.relays["nginx"] = start_nginx(binary, world.upstream, directory, world.processes)


def step_profile(world: World, directory: Path, args) -> dict[str, dict]:
    """The median of each step over `--step-requests` streamed requests, one at a time, through a
    gateway process of its own with the step timing on."""
    out = directory / "steps.json"
    url, process = start_gateway(
        world, directory, 1, "gateway-steps", {"PORTAL_GATEWAY_STEP_TIMING": str(out)}
    )
    try:
        wait_gateway(directory, "gateway-steps", url, process)
        headers = {"Authorization": f"Bearer {world.token}"}
        target = f"{url}/v1/chat/completions"
        for _ in range(2):  # warm, then measured: the samples of the warm-up are few and early
            asyncio.run(_sequential(target, headers, requests=max(5, args.step_requests // 10), args=args))
        asyncio.run(_sequential(target, headers, requests=args.step_requests, args=args))
    finally:
        stop(process)  # graceful: the process writes its medians as it exits
    return json.loads(out.read_text()) if out.exists() else {}


async def _sequential(url: str, headers: dict, *, requests: int, args) -> None:
    """`requests` streamed requests, one after the other (closed loop of one stream)."""
    done = 0
    while done < requests:
        result = await closed_loop(url, headers, concurrency=1, duration=0.2, chunks=args.chunks)
        done += result["requests"]


def print_tables(summary: dict[int, dict], steps: dict[str, dict], args, relays: tuple[str, ...]) -> None:
    levels = args.levels

    def row(label: str, key: str, spec: str, sign: bool = False) -> list[str]:
        return [label, *(f"{summary[lv][key]:{'+' if sign else ''}{spec}}" for lv in levels)]

    print()
    print(
        f"Gateway overhead: one gateway process (auth, quotas, admission, usage on) against a fake upstream "
        f"streaming {args.chunks} chunks {args.interval_ms:g} ms apart; closed loop, {args.duration:g} s per "
        f"run, medians of {args.rounds} rounds"
    )
    header = ["", *(f"{lv} stream{'s' if lv > 1 else ''}" for lv in levels)]

    def added_rows(label: str = "", prefix: str = "") -> list[list[str]]:
        return [
            row(f"{label}added P50 time to first chunk, ms", f"{prefix}added_first_ms", ".2f", sign=True),
            row(f"{label}added P50 time to last chunk, ms", f"{prefix}added_last_ms", ".2f", sign=True),
            row(f"{label}added time per relayed chunk, ms", f"{prefix}added_per_chunk_ms", ".3f", sign=True),
            row(f"{label}added P50 end-to-end per stream, ms", f"{prefix}added_end_ms", ".2f", sign=True),
            row(f"{label}added time, last chunk to body end, ms", f"{prefix}added_tail_ms", ".2f", sign=True),
            row(
                f"{label}(added end-to-end − added first) ÷ (chunks − 1), ms",
                f"{prefix}added_end_per_chunk_ms",
                ".3f",
                sign=True,
            ),
            row(f"{label}throughput ÷ direct", f"{prefix}throughput_ratio", ".3f"),
        ]

    rows = added_rows()
    for relay in relays:
        rows += added_rows(f"{relay}: ", f"{relay}_")
        rows.append(row(f"{relay}: relay CPU per request, ms", f"{relay}_cpu_ms_per_request", ".2f"))
    rows += [
        [
            "direct P50 first / last chunk / end, ms",
            *(
                f"{summary[lv]['direct_first_ms']:.2f} / {summary[lv]['direct_last_ms']:.2f} / "
                f"{summary[lv]['direct_end_ms']:.2f}"
                for lv in levels
            ),
        ],
        row("requests/s direct", "direct_req_s", ".1f"),
        row("requests/s through the gateway", "gateway_req_s", ".1f"),
        row("CPU, cores: gateway process", "gateway_cpu", ".2f"),
        row("gateway CPU per request, ms", "gateway_cpu_ms_per_request", ".2f"),
        row("CPU, cores: upstream (direct)", "upstream_cpu_direct", ".2f"),
        row("CPU, cores: upstream (via gateway)", "upstream_cpu_gateway", ".2f"),
        row("CPU, cores: Redis", "redis_cpu", ".2f"),
        row("CPU, cores: client (direct)", "client_cpu_direct", ".2f"),
        row("CPU, cores: client (via gateway)", "client_cpu_gateway", ".2f"),
    ]
    print(table(header, rows))
    print()
    print("One request's path, a gateway process with step timing on, one stream: median µs per step")
    step_rows = [
        [
            name,
            f"{steps[name]['median_us']:.0f}",
            _us(steps[name]["median_cpu_us"]),
            str(steps[name]["samples"]),
        ]
        for name in STEPS
        if name in steps
    ]
    print(table(["step", "wall µs", "CPU µs", "requests"], step_rows))
    print(
        "(CPU: the event loop thread's; wall includes waiting on Redis and upstream, and being descheduled)"
    )


def _us(value: float | None) -> str:
    return "" if value is None else f"{value:.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", default="1,8,64", help="concurrent streams, comma-separated")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--duration", type=float, default=3.0, help="seconds per run")
    parser.add_argument("--chunks", type=int, default=32)
    parser.add_argument("--interval-ms", type=float, default=5)
    parser.add_argument("--step-requests", type=int, default=300)
    parser.add_argument("--json", help="write every run, the medians and the steps here")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory (logs, database)")
    args = parser.parse_args()
    try:
        args.levels = [int(x) for x in args.levels.split(",")]
    except ValueError:
        parser.error("--levels: comma-separated integers, e.g. 1,8,64")
    if not args.levels or any(not 1 <= lv <= 4096 for lv in args.levels):
        parser.error("--levels: each between 1 and 4096")
    if args.rounds < 1 or args.chunks < 2 or args.step_requests < 1:
        parser.error("--rounds and --step-requests at least 1, --chunks at least 2")
    args.workers = [1]
    started = time.monotonic()
    with running_world("gateway overhead", args) as (world, directory):
        start_relays(world, directory)
        relays = tuple(world.relays)
        rounds = run_rounds(world, args)
        summary = {level: summarize(rounds[level], args.chunks, relays) for level in args.levels}
        steps = step_profile(world, directory, args)
        print_tables(summary, steps, args, relays)
        print(f"({time.monotonic() - started:.0f} s)")
        if args.json:
            config = {k: v for k, v in vars(args).items() if k != "json"}
            Path(args.json).write_text(
                json.dumps({"config": config, "rounds": rounds, "summary": summary, "steps": steps}, indent=2)
                + "\n"
            )


if __name__ == "__main__":
    main()
