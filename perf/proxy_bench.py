"""The gateway's proxy benchmark: the same closed-loop streaming load, direct and through the gateway.

    .venv/bin/python -m perf.proxy_bench [--levels 64,8] [--workers 1,2] [--duration 5] [--repeats 3]
        [--chunks 32] [--interval-ms 5] [--json out.json]

A throwaway world on 127.0.0.1, in a temporary directory (the machine's PostgreSQL
and Redis are not touched): a SQLite database (migrated), a private
`redis-server`, and a fast OpenAI-compatible streaming upstream
(perf/fake_upstream.py, 32 chunks 5 ms apart) registered as an adopted endpoint
through the portal's services, with a team and key whose quotas are set but too
high to bind (rpm, tpm, tokens/day, concurrency on both; a deployment cap), so
every check still runs. For each `--workers` count N it starts one gateway
(`uvicorn --workers N`, uvloop + httptools, as in production) on its own port,
and one usage flusher (the Celery task's loop) for all of them.

Then, for each repetition and level, it runs the load directly against the
upstream and through each gateway, side by side (the order rotates every
repetition), every request through the one streaming client
(`inference.loadgen.client.stream_request`), and prints requests/s, chunks/s and
TTFT P50/P99 (`inference.loadgen.summary.percentile`), the CPU the gateway's
processes and the client used, and the ratios: gateway ÷ direct, and N
processes ÷ 1 process. Medians over the repetitions. It also counts the Redis
commands the gateway ran per request (`INFO commandstats`: the calls its Lua
scripts make, and the round trips).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from devtools import free_port, wait_for_http
from perf._common import flusher_loop, start, table, tear_down
from perf._world import adopted_endpoint, log_file, start_private_redis, use_throwaway_portal

MODEL = "bench-fake-model"
HIGH = {"rpm_limit": 10**7, "tpm_limit": 10**9, "tokens_per_day": 10**12, "max_concurrent": 10_000}
CLK_TCK = os.sysconf("SC_CLK_TCK")


@dataclass
class World:
    processes: list[subprocess.Popen] = field(default_factory=list)
    upstream: str = ""
    upstream_pid: int = 0
    redis_port: int = 0
    token: str = ""
    # uvicorn --workers N → (its URL, its process)
    gateways: dict[int, tuple[str, subprocess.Popen]] = field(default_factory=dict)
    # relays without the portal that a benchmark runs beside it, by name ("floor": perf/relay_floor.py,
    # "nginx": perf/nginx_relay.py) → (its URL, its process)
    relays: dict[str, tuple[str, subprocess.Popen]] = field(default_factory=dict)


def build_world(world: World, directory: Path, args) -> None:
    """Redis, the upstream, the database, the key, the gateways and the flusher; processes go in
    `world.processes` as they start, so the caller stops whatever did start."""
    upstream_port = free_port()
    redis_url = start_private_redis(directory, world.processes)
    world.redis_port = int(redis_url.rsplit(":", 1)[1])
    use_throwaway_portal(directory, redis_url, label="proxy-bench")
    upstream = start(
        ["-m", "perf.fake_upstream", "--port", str(upstream_port), "--chunks", str(args.chunks),
         "--interval-ms", str(args.interval_ms), "--model", MODEL],
        stdout=log_file(directory, "upstream"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    world.processes.append(upstream)
    world.upstream, world.upstream_pid = f"http://127.0.0.1:{upstream_port}", upstream.pid
    wait_for_http(f"{world.upstream}/health", watch=upstream, timeout_s=60)
    world.token = setup_portal(world.upstream)

    for workers in args.workers:
        world.gateways[workers] = start_gateway(world, directory, workers, f"gateway-{workers}")
    world.processes.append(
        start(["-m", "perf.proxy_bench", "--flusher"], stdout=log_file(directory, "flusher"),
              stderr=subprocess.STDOUT)
    )  # fmt: skip
    for workers, (url, process) in world.gateways.items():
        _wait_workers(directory / f"gateway-{workers}.log", process, workers)
        wait_for_http(f"{url}/v1/models", watch=process, timeout_s=60)


@contextlib.contextmanager
def running_world(label: str, args) -> Iterator[tuple[World, Path]]:
    """uvloop (when installed), a temporary directory and the world built in it (`build_world`);
    on the way out every process stopped and the directory removed (kept with `args.keep`)."""
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    directory = Path(tempfile.mkdtemp(prefix=label.replace(" ", "-") + "-"))
    world = World()
    try:
        print(f"{label}: setting up in {directory}", flush=True)
        build_world(world, directory, args)
        yield world, directory
    finally:
        tear_down(world.processes, directory, keep=args.keep, label=label)


def start_gateway(
    world: World,
    directory: Path,
    workers: int,
    name: str,
    env: dict[str, str] | None = None,
    app: str = "portal.asgi:application",
) -> tuple[str, subprocess.Popen]:
    """`uvicorn --workers N` as in production, on a free port, logging to `<name>.log`: (URL, process)."""
    port = free_port()
    gateway = start(
        ["-m", "uvicorn", app, "--host", "127.0.0.1", "--port", str(port),
         "--workers", str(workers), "--loop", "uvloop", "--http", "httptools", "--no-access-log",
         "--log-level", "info", "--timeout-graceful-shutdown", "3"],
        stdout=log_file(directory, name), stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
    )  # fmt: skip
    world.processes.append(gateway)
    return f"http://127.0.0.1:{port}", gateway


def wait_gateway(directory: Path, name: str, url: str, process: subprocess.Popen, workers: int = 1) -> None:
    _wait_workers(directory / f"{name}.log", process, workers)
    wait_for_http(f"{url}/v1/models", watch=process, timeout_s=60)


def _wait_workers(log_path: Path, process: subprocess.Popen, workers: int, timeout: float = 120) -> None:
    """Until each of uvicorn's workers has loaded the application (it logs this line after)."""
    deadline = time.monotonic() + timeout
    while log_path.read_text(errors="replace").count("Started server process") < workers:
        if process.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the gateway with {workers} workers did not start (see {log_path})")
        time.sleep(0.2)


def setup_portal(upstream: str) -> str:
    """The adopted upstream with a cap that never binds, and a key with every quota high (returned)."""
    team, deployment = adopted_endpoint(
        upstream=upstream, model=MODEL, config="llama-2-7b-chat-hf", name="proxy-bench",
        team={"name": "Proxy bench", "slug": "proxy-bench", **HIGH},
    )  # fmt: skip
    # Imported once adopted_endpoint has set Django up.
    from portal.deployments.services import deployment_set_concurrency_cap
    from portal.teams.services import api_key_create

    deployment_set_concurrency_cap(deployment=deployment, cap=10_000, source="proxy bench: never binds")
    _key, token = api_key_create(team=team, name="proxy bench", allowed_models=[MODEL], **HIGH)
    return token


# --- measuring ----------------------------------------------------------------------------------------


def group_cpu_s(pgid: int) -> float:
    """CPU seconds (user + system) used so far by every live process in process group `pgid`."""
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(fields[2]) == pgid:  # fields after the command: state, ppid, pgrp, …, utime (11), stime (12)
            total += int(fields[11]) + int(fields[12])
    return total / CLK_TCK


def connections_per_process(pgid: int, port: int) -> list[int]:
    """Established connections on `port` held by each process of group `pgid` (how uvicorn's workers
    shared the clients: they accept from one socket, the kernel does not balance them)."""
    inodes = set()
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(FileNotFoundError):
            for line in Path(name).read_text().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "01" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(int(fields[9]))
    counts = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[2]) != pgid:
                continue
            links = [os.readlink(f"/proc/{entry}/fd/{fd}") for fd in os.listdir(f"/proc/{entry}/fd")]
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        held = sum(1 for link in links if link.startswith("socket:[") and int(link[8:-1]) in inodes)
        if held:
            counts.append(held)
    return sorted(counts, reverse=True)


def redis_calls(port: int) -> dict[str, int]:
    """Calls per command since the last reset (commands run inside Lua scripts are counted too)."""
    import redis

    client = redis.Redis(host="127.0.0.1", port=port)
    try:
        stats = client.info("commandstats")
    finally:
        client.close()
    return {name.removeprefix("cmdstat_"): int(value["calls"]) for name, value in stats.items()}


def redis_reset(port: int) -> None:
    import redis

    client = redis.Redis(host="127.0.0.1", port=port)
    try:
        client.config_resetstat()
    finally:
        client.close()


async def closed_loop(url: str, headers: dict, *, concurrency: int, duration: float, chunks: int) -> dict:
    """`concurrency` users, each sending its next streamed request as soon as the last ends; requests
    started within `duration` count, and throughput is over the time until the last of them ended."""
    import aiohttp

    from inference.loadgen.client import RequestInput, completion_body, stream_request
    from inference.loadgen.summary import percentile

    body = json.dumps(completion_body(MODEL, "Say something.", max_tokens=chunks, chat=True)).encode()
    request = RequestInput(url=url, body=body, headers=headers, timeout_s=60, expected_output_tokens=chunks)
    records = []
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        stop_at = time.perf_counter() + duration

        async def user() -> None:
            while time.perf_counter() < stop_at:
                records.append(await stream_request(session, request))

        started, cpu_started = time.perf_counter(), time.process_time()
        await asyncio.gather(*[user() for _ in range(concurrency)])
        elapsed = time.perf_counter() - started
        client_cpu = (time.process_time() - cpu_started) / elapsed
    ok = [r for r in records if r.ok]
    ttfts = [r.ttft for r in ok]
    lasts = [r.e2el for r in ok]
    # The end of the body as the client sees it (the last byte read, `[DONE]` and the chunked end
    # included, the response released), not the last token: what the gateway does after the last
    # token (accounting) shows here and not in `lasts`.
    ends = [r.end - r.start for r in ok]
    return {
        "req_s": len(ok) / elapsed,
        "chunks_s": sum(len(r.token_times) for r in ok) / elapsed,
        "ttft_p50_ms": percentile(ttfts, 50) * 1000 if ttfts else float("nan"),
        "ttft_p99_ms": percentile(ttfts, 99) * 1000 if ttfts else float("nan"),
        "last_chunk_p50_ms": percentile(lasts, 50) * 1000 if lasts else float("nan"),
        "end_p50_ms": percentile(ends, 50) * 1000 if ends else float("nan"),
        "errors": len(records) - len(ok),
        "requests": len(ok),
        "elapsed_s": elapsed,
        "client_cpu": client_cpu,
    }


def measure(world: World, target: str, level: int, args) -> dict:
    """One run of the load against `target` ("direct", "gateway-N" or one of `world.relays`), with the
    CPU its server used."""
    if target == "direct":
        url, headers, pgid = f"{world.upstream}/v1/chat/completions", {}, None
    elif target in world.relays:
        base, process = world.relays[target]
        url, headers, pgid = f"{base}/v1/chat/completions", {}, process.pid
    else:
        base, process = world.gateways[int(target.split("-")[1])]
        url, pgid = f"{base}/v1/chat/completions", process.pid
        headers = {"Authorization": f"Bearer {world.token}"}
    redis_pgid = world.processes[0].pid  # redis-server, first started, in a process group of its own
    cpu_before = group_cpu_s(pgid) if pgid else 0.0
    redis_cpu_before = group_cpu_s(redis_pgid)
    upstream_cpu_before = group_cpu_s(world.upstream_pid)
    redis_reset(world.redis_port)
    spread: list[int] = []
    if pgid:  # sampled halfway through the run
        port = int(url.split(":")[2].split("/")[0])
        timer = threading.Timer(args.duration / 2, lambda: spread.extend(connections_per_process(pgid, port)))
        timer.start()
    result = asyncio.run(
        closed_loop(url, headers, concurrency=level, duration=args.duration, chunks=args.chunks)
    )
    calls = redis_calls(world.redis_port)
    redis_cpu = group_cpu_s(redis_pgid) - redis_cpu_before
    result["upstream_cpu"] = (group_cpu_s(world.upstream_pid) - upstream_cpu_before) / result["elapsed_s"]
    result["redis_cpu"] = redis_cpu / result["elapsed_s"]
    result["connections_per_process"] = spread
    result["server_cpu"] = (group_cpu_s(pgid) - cpu_before) / result["elapsed_s"] if pgid else float("nan")
    if pgid and result["requests"]:
        # Every command counts, the flusher's and the metrics flush's too: they are part of what a
        # request costs Redis. evalsha calls are the script runs (round trips); the commands the
        # scripts run inside are counted under their own names as well.
        result["redis_calls"] = {name: n / result["requests"] for name, n in calls.items()}
        result["redis_commands_per_request"] = (
            sum(n for name, n in calls.items() if name not in ("evalsha", "eval", "config|resetstat", "info"))
            / result["requests"]
        )
        scripts = calls.get("evalsha", 0) + calls.get("eval", 0)
        result["redis_scripts_per_request"] = scripts / result["requests"]
        result["redis_cpu_ms_per_request"] = redis_cpu * 1000 / result["requests"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", default="64,8", help="concurrent streams, comma-separated")
    parser.add_argument(
        "--workers", default="1,2", help="uvicorn --workers N for one gateway each, comma-separated"
    )
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per measurement")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--chunks", type=int, default=32)
    parser.add_argument("--interval-ms", type=float, default=5)
    parser.add_argument("--json", help="write every run and the medians here")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory (logs, database)")
    parser.add_argument("--flusher", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.flusher:
        return flusher_loop()
    args.levels = _counts(parser, "--levels", args.levels, 1, 4096)
    args.workers = _counts(parser, "--workers", args.workers, 1, 16)
    with running_world("proxy bench", args) as (world, _directory):
        targets = ["direct", *[f"gateway-{n}" for n in args.workers]]
        # Warm up every path (connections, caches, the key row in each worker).
        for target in targets:
            measure(world, target, 8, argparse.Namespace(**{**vars(args), "duration": 1.0}))
        results: dict[tuple[int, str], list[dict]] = {}
        for rep in range(args.repeats):
            for level in args.levels:
                order = targets[rep % len(targets) :] + targets[: rep % len(targets)]
                for target in order:
                    result = measure(world, target, level, args)
                    results.setdefault((level, target), []).append(result)
                    print(
                        f"  rep {rep + 1} c={level:<3} {target:<10} {result['req_s']:8.1f} req/s "
                        f"{result['chunks_s']:9.0f} chunks/s  TTFT P50 {result['ttft_p50_ms']:6.2f} ms "
                        f"P99 {result['ttft_p99_ms']:7.2f} ms  server CPU {result['server_cpu']:4.2f}  "
                        f"client CPU {result['client_cpu']:4.2f}  errors {result['errors']}"
                        + (f"  connections {c}" if (c := result["connections_per_process"]) else ""),
                        flush=True,
                    )
        print_table(results, args)
        if args.json:
            runs = [{"level": lv, "target": t, "runs": rs} for (lv, t), rs in results.items()]
            Path(args.json).write_text(json.dumps({"config": {k: v for k, v in vars(args).items()
                                                              if k != "flusher"}, "results": runs},
                                                  indent=2) + "\n")  # fmt: skip


def _counts(parser: argparse.ArgumentParser, flag: str, text: str, low: int, high: int) -> list[int]:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        parser.error(f"{flag}: comma-separated integers, e.g. 1,2")
    if not values or any(not low <= v <= high for v in values):
        parser.error(f"{flag}: each between {low} and {high}")
    return values


def print_table(results: dict, args) -> None:
    def med(level: int, target: str, metric: str) -> float:
        return statistics.median(r[metric] for r in results[(level, target)])

    def row(level: int, target: str, label: str, ratios: str, server_cpu: str) -> list[str]:
        specs = (("req_s", ".1f"), ("chunks_s", ".0f"), ("ttft_p50_ms", ".2f"), ("ttft_p99_ms", ".2f"))
        cells = [f"{med(level, target, metric):{spec}}" for metric, spec in specs]
        return [str(level), label, *cells, ratios, server_cpu, f"{med(level, target, 'client_cpu'):.2f}"]

    rows = []
    for level in args.levels:
        direct = med(level, "direct", "req_s")
        rows.append(row(level, "direct", "direct", "", ""))
        first = med(level, f"gateway-{args.workers[0]}", "req_s")
        for n in args.workers:
            target = f"gateway-{n}"
            rate = med(level, target, "req_s")
            ratios = f"{rate / direct:.2f} / {rate / first:.2f}"
            cpu = f"{med(level, target, 'server_cpu'):.2f}"
            rows.append(row(level, target, f"gateway ×{n}", ratios, cpu))
    print()
    print(
        f"Proxy benchmark: closed loop, {args.chunks} chunks {args.interval_ms:g} ms apart, "
        f"{args.duration:g} s per run, median of {args.repeats} runs; gateway ×N = uvicorn --workers N "
        "(auth + quotas + usage on)"
    )
    header = ["streams", "path", "req/s", "chunks/s", "TTFT P50 ms", "TTFT P99 ms",
              f"÷ direct / ÷ ×{args.workers[0]}", "gateway CPU", "client CPU"]  # fmt: skip
    print(table(header, rows, left=(1,)))
    print("(CPU: cores busy during the run, all of the gateway's processes; the client is one event loop)")
    for level in args.levels:
        for n in args.workers:
            target = f"gateway-{n}"
            per = med(level, target, "redis_commands_per_request")
            scripts = med(level, target, "redis_scripts_per_request")
            cpu_ms = med(level, target, "redis_cpu_ms_per_request")
            top = sorted(results[(level, target)][0]["redis_calls"].items(), key=lambda kv: -kv[1])[:8]
            print(
                f"Redis at {level} streams, gateway ×{n}: {per:.1f} commands per request in {scripts:.2f} "
                f"script runs, {cpu_ms:.3f} ms of Redis CPU per request; first run: "
                + ", ".join(f"{name} {v:.2f}" for name, v in top)
            )


if __name__ == "__main__":
    main()
