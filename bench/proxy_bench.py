"""The gateway's proxy benchmark: the same closed-loop streaming load, direct and through the gateway.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/portal REDIS_URL=redis://127.0.0.1:6379/0 \\
        .venv/bin/python -m bench.proxy_bench [--levels 64,8] [--duration 5] [--repeats 3] [--chunks 32]

Starts a fast local OpenAI-compatible streaming upstream (bench/fake_upstream.py,
32 chunks 5 ms apart), one gateway web process (uvicorn, uvloop + httptools, as in
production) with auth, quotas (team and key: rpm, tpm, tokens/day, concurrency;
a deployment cap) and usage recording on, and a usage flusher process (the Celery
task's loop). Then, for each level and repetition, runs the load directly against
the upstream and through the gateway, side by side (alternating which goes first),
and prints requests/s, chunks/s and TTFT P50/P99 for both, with their ratio:
medians over the repetitions.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

from bench._common import flusher_loop, free_port, start, stop, table, wait_up

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
os.environ.setdefault("SECRET_KEY", "proxy-bench-only-secret-key-0123456789abcdefghijklmnop")
os.environ.setdefault("SECURE_SSL_REDIRECT", "false")
os.environ.setdefault("LOG_LEVEL", "WARNING")

MODEL = "bench-fake-model"


def setup_portal(upstream: str) -> str:
    """Team, model, deployment on the fake upstream, and a fresh key (returned)."""
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    from portal.deployments.models import Deployment, DeploymentProfile
    from portal.inventory.models import Node
    from portal.registry.models import ModelVersion
    from portal.registry.services import model_version_create
    from portal.teams.models import Team
    from portal.teams.services import api_key_create
    from tests.conftest import bundled_config

    # Quotas high enough never to refuse, so every check still runs.
    team, _ = Team.objects.update_or_create(
        slug="proxy-bench",
        defaults={"name": "Proxy bench", "rpm_limit": 10**7, "tpm_limit": 10**9, "tokens_per_day": 10**12,
                  "max_concurrent": 10_000},
    )  # fmt: skip
    version = ModelVersion.objects.filter(name=MODEL).first() or model_version_create(
        name=MODEL, config=bundled_config("llama-2-7b-chat-hf")
    )
    profile, _ = DeploymentProfile.objects.get_or_create(
        name="proxy-bench", defaults={"model_version": version}
    )
    node, _ = Node.objects.get_or_create(name="proxy-bench", defaults={"hostname": "127.0.0.1"})
    Deployment.objects.update_or_create(
        name="proxy-bench",
        defaults={"team": team, "model_version": version, "profile": profile, "node": node,
                  "desired_state": "running", "state": "serving", "endpoint_url": upstream,
                  "concurrency_cap": 10_000},
    )  # fmt: skip
    _key, token = api_key_create(
        team=team, name="proxy bench", allowed_models=[MODEL], rpm_limit=10**7, tpm_limit=10**9,
        tokens_per_day=10**12, max_concurrent=10_000,
    )  # fmt: skip
    return token


async def closed_loop(url: str, headers: dict, *, concurrency: int, duration: float, max_tokens: int) -> dict:
    """`concurrency` users, each sending its next streamed request as soon as the last ends."""
    import aiohttp

    body = {"model": MODEL, "messages": [{"role": "user", "content": "Say something."}], "stream": True,
            "max_tokens": max_tokens}  # fmt: skip
    ttfts: list[float] = []
    chunks = 0
    done = 0
    errors = 0
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        stop_at = time.perf_counter() + duration

        async def user() -> None:
            nonlocal chunks, done, errors
            while time.perf_counter() < stop_at:
                t0 = time.perf_counter()
                first = None
                n = 0
                async with session.post(url, json=body, headers=headers) as response:
                    if response.status != 200:
                        errors += 1
                        await response.read()
                        continue
                    async for data in response.content.iter_any():
                        if first is None:
                            first = time.perf_counter() - t0
                        n += data.count(b"data: ")
                ttfts.append(first)
                chunks += n
                done += 1

        started = time.perf_counter()
        await asyncio.gather(*[user() for _ in range(concurrency)])
        elapsed = time.perf_counter() - started
    ttfts.sort()
    return {
        "req_s": done / elapsed,
        "chunks_s": chunks / elapsed,
        "ttft_p50_ms": statistics.median(ttfts) * 1000 if ttfts else float("nan"),
        "ttft_p99_ms": ttfts[min(len(ttfts) - 1, int(len(ttfts) * 0.99))] * 1000 if ttfts else float("nan"),
        "errors": errors,
        "requests": done,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", default="64,8")
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per measurement")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--chunks", type=int, default=32)
    parser.add_argument("--interval-ms", type=float, default=5)
    parser.add_argument("--flusher", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.flusher:
        return flusher_loop()
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass

    upstream_port, gateway_port = free_port(), free_port()
    upstream = f"http://127.0.0.1:{upstream_port}"
    gateway = f"http://127.0.0.1:{gateway_port}"
    processes = [
        start(["-m", "bench.fake_upstream", "--port", str(upstream_port), "--chunks", str(args.chunks),
               "--interval-ms", str(args.interval_ms)])
    ]  # fmt: skip
    try:
        wait_up(f"{upstream}/health", processes[0])
        token = setup_portal(upstream)
        processes.append(
            start(["-m", "uvicorn", "portal.asgi:application", "--port", str(gateway_port),
                   "--loop", "uvloop", "--http", "httptools", "--no-access-log", "--log-level", "warning"])
        )  # fmt: skip
        processes.append(start(["-m", "bench.proxy_bench", "--flusher"]))
        wait_up(f"{gateway}/v1/models", processes[1])
        targets = {
            "direct": (f"{upstream}/v1/chat/completions", {}),
            "gateway": (f"{gateway}/v1/chat/completions", {"Authorization": f"Bearer {token}"}),
        }
        levels = [int(x) for x in args.levels.split(",")]
        # Warm up both paths (connections, caches, the tokenizer).
        for url, headers in targets.values():
            asyncio.run(closed_loop(url, headers, concurrency=8, duration=1, max_tokens=args.chunks))
        results: dict[tuple[int, str], list[dict]] = {}
        for rep in range(args.repeats):
            for level in levels:
                order = ["direct", "gateway"] if rep % 2 == 0 else ["gateway", "direct"]
                for name in order:
                    url, headers = targets[name]
                    result = asyncio.run(
                        closed_loop(
                            url, headers, concurrency=level, duration=args.duration, max_tokens=args.chunks
                        )
                    )
                    results.setdefault((level, name), []).append(result)
                    print(
                        f"  rep {rep + 1} c={level:<3} {name:<8} {result['req_s']:8.1f} req/s "
                        f"{result['chunks_s']:9.0f} chunks/s  TTFT P50 {result['ttft_p50_ms']:6.2f} ms "
                        f"P99 {result['ttft_p99_ms']:7.2f} ms  errors {result['errors']}",
                        flush=True,
                    )
        print_table(results, levels, args)
    finally:
        for process in reversed(processes):
            stop(process)


def print_table(results: dict, levels: list[int], args) -> None:
    def med(level: int, name: str, metric: str) -> float:
        return statistics.median(r[metric] for r in results[(level, name)])

    rows = []
    for level in levels:
        for name in ("direct", "gateway"):
            rows.append(
                [str(level), name, f"{med(level, name, 'req_s'):.1f}", f"{med(level, name, 'chunks_s'):.0f}",
                 f"{med(level, name, 'ttft_p50_ms'):.2f}", f"{med(level, name, 'ttft_p99_ms'):.2f}"]
            )  # fmt: skip
        ratio = med(level, "gateway", "req_s") / med(level, "direct", "req_s")
        chunk_ratio = med(level, "gateway", "chunks_s") / med(level, "direct", "chunks_s")
        added = med(level, "gateway", "ttft_p50_ms") - med(level, "direct", "ttft_p50_ms")
        added99 = med(level, "gateway", "ttft_p99_ms") - med(level, "direct", "ttft_p99_ms")
        rows.append(
            [str(level), "ratio", f"{ratio:.2f}", f"{chunk_ratio:.2f}", f"{added:+.2f}", f"{added99:+.2f}"]
        )
    print()
    print(
        f"Proxy benchmark: closed loop, {args.chunks} chunks {args.interval_ms:g} ms apart, "
        f"{args.duration:g} s per run, median of {args.repeats} runs; one gateway process "
        "(auth + quotas + usage on)"
    )
    print(table(["streams", "path", "req/s", "chunks/s", "TTFT P50 ms", "TTFT P99 ms"], rows, left=(1,)))
    print("(ratio rows: gateway ÷ direct throughput; TTFT columns: gateway − direct, ms)")


if __name__ == "__main__":
    main()
