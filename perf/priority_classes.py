"""The priority-class benchmark: interactive TTFT alone, and with batch clients flooding the same cap.

    .venv/bin/python -m perf.priority_classes [--cap 8] [--share 0.5] [--batch-clients 16]
        [--interactive-rate 10] [--arrivals poisson|fixed] [--duration 10] [--repeats 3]
        [--chunks 32] [--interval-ms 5] [--seed 1] [--json out.json] [--check]

A throwaway world on 127.0.0.1, in a temporary directory, as perf/proxy_bench.py
builds it (the machine's PostgreSQL and Redis are not touched): a SQLite database,
a private `redis-server`, the deterministic fake upstream (perf/fake_upstream.py:
every request `--chunks` chunks `--interval-ms` apart, whatever the load) registered
as an adopted endpoint with a fixed gateway cap (`--cap`), one team with an
interactive key and a batch key, and one gateway process (uvicorn, uvloop,
httptools) with `GATEWAY_BATCH_SHARE=--share`.

Each repetition runs two phases of `--duration` seconds: interactive alone
(streamed requests arriving at `--interactive-rate` per second, Poisson or evenly
spaced, the same seeded schedule in both phases), then the same interactive load
while `--batch-clients` closed-loop batch clients flood the deployment (they start
a second early, so their share is taken when the interactive clock starts).
It prints, per phase, interactive TTFT P50/P95 and P50 ÷ the alone phase's, and
the batch requests completed in the phase, their rate and their P50 TTFT (which
includes their wait in the batch queue). Medians over the repetitions.
The target: interactive P50 with batch ≤ 1.10 × alone (`--check` exits 1 if missed).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
from pathlib import Path

from devtools import free_port, wait_for_http
from perf._common import scratch, start, table
from perf._world import adopted_endpoint, log_file, start_private_redis, use_throwaway_portal

MODEL = "priority-bench-model"
TARGET_RATIO = 1.10
BATCH_LEAD_S = 1.0  # batch clients start this long before the interactive clock


def build_world(processes: list[subprocess.Popen], directory: Path, args) -> tuple[str, str, str]:
    """Redis, the upstream, the database, the keys, the gateway; returns (gateway URL, interactive
    token, batch token). Processes go in `processes` as they start, so the caller stops them."""
    upstream_port, gateway_port = free_port(), free_port()
    redis_url = start_private_redis(directory, processes)
    use_throwaway_portal(
        directory, redis_url, label="priority-bench",
        GATEWAY_BATCH_SHARE=str(args.share),
        # Nobody gives up waiting: the benchmark measures waits, not refusals.
        GATEWAY_QUEUE_TIMEOUT_S="120", GATEWAY_BATCH_QUEUE_TIMEOUT_S="600", GATEWAY_QUEUE_MAX="4096",
    )  # fmt: skip
    upstream = start(
        ["-m", "perf.fake_upstream", "--port", str(upstream_port), "--chunks", str(args.chunks),
         "--interval-ms", str(args.interval_ms), "--model", MODEL],
        stdout=log_file(directory, "upstream"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    processes.append(upstream)
    upstream_url = f"http://127.0.0.1:{upstream_port}"
    wait_for_http(f"{upstream_url}/health", watch=upstream, timeout_s=60)
    tokens = setup_portal(upstream_url, cap=args.cap)
    gateway = start(
        ["-m", "uvicorn", "portal.asgi:application", "--host", "127.0.0.1", "--port", str(gateway_port),
         "--loop", "uvloop", "--http", "httptools", "--no-access-log", "--log-level", "warning",
         "--timeout-graceful-shutdown", "3"],
        stdout=log_file(directory, "gateway"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    processes.append(gateway)
    url = f"http://127.0.0.1:{gateway_port}"
    wait_for_http(f"{url}/v1/models", watch=gateway, timeout_s=60)
    return url, *tokens


def setup_portal(upstream: str, *, cap: int) -> tuple[str, str]:
    """The adopted upstream with the cap; an interactive key and a batch key (returned)."""
    team, deployment = adopted_endpoint(
        upstream=upstream, model=MODEL, config="llama-2-7b-chat-hf", name="priority-bench",
        team={"name": "Priority bench", "slug": "priority-bench"},
    )  # fmt: skip
    # Imported once adopted_endpoint has set Django up.
    from portal.deployments.services import deployment_set_concurrency_cap
    from portal.teams.models import PriorityClass
    from portal.teams.services import api_key_create

    deployment_set_concurrency_cap(deployment=deployment, cap=cap, source="priority bench")
    _key, interactive = api_key_create(team=team, name="interactive", allowed_models=[MODEL])
    _key, batch = api_key_create(
        team=team, name="batch", allowed_models=[MODEL], priority_class=PriorityClass.BATCH
    )
    return interactive, batch


# --- measuring ----------------------------------------------------------------------------------------


def arrival_offsets(args, seed: int) -> list[float]:
    """When each interactive request starts, seconds into the phase (the same in both phases)."""
    rng = random.Random(seed)  # noqa: S311 (a reproducible schedule, not a secret)
    offsets, t = [], 0.0
    while True:
        rate = args.interactive_rate
        t += rng.expovariate(rate) if args.arrivals == "poisson" else 1 / rate
        if t >= args.duration:
            return offsets
        offsets.append(t)


async def phase(url: str, tokens: tuple[str, str], args, *, batch: bool, offsets: list[float]) -> dict:
    """One phase: the interactive schedule, with or without the batch flood."""
    import aiohttp

    from inference.loadgen.client import RequestInput, completion_body, stream_request
    from inference.loadgen.summary import percentile

    body = json.dumps(completion_body(MODEL, "Say something.", max_tokens=args.chunks, chat=True)).encode()

    def request(token: str) -> RequestInput:
        return RequestInput(
            url=f"{url}/v1/chat/completions", body=body, headers={"Authorization": f"Bearer {token}"},
            timeout_s=600, expected_output_tokens=args.chunks,
        )  # fmt: skip

    interactive_request, batch_request = request(tokens[0]), request(tokens[1])
    interactive, flood = [], []
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        loop = asyncio.get_running_loop()
        flooding = True

        async def batch_client() -> None:
            while flooding:
                record = await stream_request(session, batch_request)
                if flooding:  # requests still running when the phase ends are not counted
                    flood.append(record)

        async def one_interactive(at: float) -> None:
            await asyncio.sleep(max(0.0, at - loop.time()))
            interactive.append(await stream_request(session, interactive_request))

        clients = [asyncio.create_task(batch_client()) for _ in range(args.batch_clients if batch else 0)]
        if batch:
            await asyncio.sleep(BATCH_LEAD_S)
        flood.clear()  # only batch work done while the interactive clock runs counts
        zero = loop.time()
        await asyncio.gather(*[one_interactive(zero + t) for t in offsets])
        elapsed = loop.time() - zero
        flooding = False
        for client in clients:
            client.cancel()
        await asyncio.gather(*clients, return_exceptions=True)
    ok = [r for r in interactive if r.ok]
    ttfts = [r.ttft * 1000 for r in ok]
    batch_ok = [r for r in flood if r.ok]
    batch_ttfts = [r.ttft * 1000 for r in batch_ok]
    nan = float("nan")
    return {
        "interactive_requests": len(ok),
        "interactive_errors": len(interactive) - len(ok),
        "ttft_p50_ms": percentile(ttfts, 50) if ttfts else nan,
        "ttft_p95_ms": percentile(ttfts, 95) if ttfts else nan,
        "batch_completed": len(batch_ok),
        "batch_errors": len(flood) - len(batch_ok),
        "batch_req_s": len(batch_ok) / elapsed,
        "batch_ttft_p50_ms": percentile(batch_ttfts, 50) if batch_ttfts else nan,
        "elapsed_s": elapsed,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cap", type=int, default=8, help="the deployment's gateway concurrency cap")
    parser.add_argument("--share", type=float, default=0.5, help="GATEWAY_BATCH_SHARE (0 < share ≤ 1)")
    parser.add_argument("--batch-clients", type=int, default=16, help="closed-loop batch clients")
    parser.add_argument(
        "--interactive-rate", type=float, default=10.0, help="interactive requests per second"
    )
    parser.add_argument("--arrivals", choices=["poisson", "fixed"], default="poisson")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per phase")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--chunks", type=int, default=32)
    parser.add_argument("--interval-ms", type=float, default=5)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", help="write every run and the medians here")
    parser.add_argument(
        "--check", action="store_true", help=f"exit 1 if the P50 ratio exceeds {TARGET_RATIO}"
    )
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory (logs, database)")
    args = parser.parse_args()
    _check_args(parser, args)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    with scratch("priority bench", keep=args.keep) as (directory, processes):
        print(f"priority bench: setting up in {directory}", flush=True)
        url, *tokens = build_world(processes, directory, args)
        # Warm up: connections, the key rows, the route.
        asyncio.run(phase(url, tokens, args, batch=True, offsets=[0.1, 0.2, 0.3]))
        runs: dict[str, list[dict]] = {"alone": [], "with batch": []}
        for rep in range(args.repeats):
            offsets = arrival_offsets(args, args.seed + rep)
            for name, batch in (("alone", False), ("with batch", True)):
                result = asyncio.run(phase(url, tokens, args, batch=batch, offsets=offsets))
                runs[name].append(result)
                print(
                    f"  rep {rep + 1} {name:<10} interactive {result['interactive_requests']:4d} "
                    f"TTFT P50 {result['ttft_p50_ms']:7.2f} ms P95 {result['ttft_p95_ms']:7.2f} ms  "
                    f"batch {result['batch_completed']:5d} done, "
                    f"P50 TTFT {result['batch_ttft_p50_ms']:8.1f} ms  "
                    f"errors {result['interactive_errors']}/{result['batch_errors']}",
                    flush=True,
                )
        ratio = print_table(runs, args)
        if args.json:
            Path(args.json).write_text(
                json.dumps({"config": vars(args), "runs": runs, "p50_ratio": ratio}, indent=2) + "\n"
            )
    return 1 if args.check and not ratio <= TARGET_RATIO else 0


def _check_args(parser: argparse.ArgumentParser, args) -> None:
    if not 1 <= args.cap <= 1024:
        parser.error("--cap: between 1 and 1024")
    if not 0 < args.share <= 1:
        parser.error("--share: above 0 and at most 1")
    if not 0 <= args.batch_clients <= 1024:
        parser.error("--batch-clients: between 0 and 1024")
    if not 0 < args.interactive_rate <= 1000:
        parser.error("--interactive-rate: above 0 and at most 1000 per second")
    if not 0 < args.duration <= 3600:
        parser.error("--duration: above 0 and at most 3600 seconds")
    if not 1 <= args.repeats <= 100:
        parser.error("--repeats: between 1 and 100")
    if not 1 <= args.chunks <= 4096 or not 0 <= args.interval_ms <= 10_000:
        parser.error("--chunks: between 1 and 4096; --interval-ms: between 0 and 10000")


def print_table(runs: dict[str, list[dict]], args) -> float:
    """The table of medians; returns interactive P50 with batch ÷ alone."""

    def med(name: str, metric: str) -> float:
        return statistics.median(r[metric] for r in runs[name])

    alone = med("alone", "ttft_p50_ms")
    rows = []
    for name in runs:
        rows.append(
            [
                f"interactive {name}",
                f"{med(name, 'interactive_requests'):.0f}",
                f"{med(name, 'ttft_p50_ms'):.2f}",
                f"{med(name, 'ttft_p95_ms'):.2f}",
                f"{med(name, 'ttft_p50_ms') / alone:.2f}",
                f"{med(name, 'batch_completed'):.0f}",
                f"{med(name, 'batch_req_s'):.1f}",
                "—" if name == "alone" else f"{med(name, 'batch_ttft_p50_ms'):.0f}",
            ]
        )
    ratio = med("with batch", "ttft_p50_ms") / alone
    print()
    print(
        f"Priority classes: cap {args.cap}, batch share {args.share:g}, {args.batch_clients} batch clients "
        f"(closed loop), interactive {args.interactive_rate:g}/s ({args.arrivals}), {args.chunks} chunks "
        f"{args.interval_ms:g} ms apart, {args.duration:g} s per phase, median of {args.repeats} runs"
    )
    header = ["phase", "interactive req", "TTFT P50 ms", "TTFT P95 ms", "P50 ÷ alone", "batch done",
              "batch req/s", "batch P50 TTFT ms (wait incl.)"]  # fmt: skip
    print(table(header, rows))
    verdict = "met" if ratio <= TARGET_RATIO else "MISSED"
    print(f"target: interactive P50 with batch ≤ {TARGET_RATIO:.2f} × alone: {ratio:.3f} ({verdict})")
    return ratio


if __name__ == "__main__":
    sys.exit(main())
