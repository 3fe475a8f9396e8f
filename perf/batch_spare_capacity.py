"""The batch benchmark: a batch run on the capacity interactive traffic leaves, and what it costs them.

    .venv/bin/python -m perf.batch_spare_capacity [--lines 2000] [--cap 16] [--share 0.5]
        [--interactive-rate 4] [--duration 20] [--rounds 3] [--max-tokens 16] [--speedup 20]
        [--batch-concurrency 16] [--seed 1] [--json out.json] [--check]

A throwaway world on 127.0.0.1 (perf/_world.py: SQLite, a private Redis): the simulator
(`inference.sim`, a 7B on a V100 `--speedup` times faster) as an adopted endpoint with the
gateway cap `--cap`, one team with an interactive key and a batch key, one gateway process.

Each round runs two phases of `--duration` s with the same seeded Poisson schedule of streamed
interactive chat requests through the gateway: alone, then while a `--lines`-line batch runs
(the real runner, `portal.batches.runner.batch_run`, in a child process: it sends its lines through
the gateway's pipeline in the batch class). Printed: interactive TTFT P50/P95 in each phase and the
batch lines finished per second during the second one; medians over the rounds.
The goal: interactive P50 with the batch ≤ 1.10 × alone (`--check` exits 1 if missed).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

from devtools import free_port, stop, wait_for_http
from perf._common import scratch, start, table
from perf._world import adopted_endpoint, log_file, start_private_redis, use_throwaway_portal

MODEL = "batch-bench-model"
TARGET_RATIO = 1.10
BATCH_LEAD_S = 1.0  # the runner starts this long before the interactive clock


def build_world(processes: list[subprocess.Popen], directory: Path, args) -> tuple[str, str, str]:
    """Redis, the simulator, the database, the keys, the gateway: (gateway URL, interactive token,
    batch key's id)."""
    sim_port, gateway_port = free_port(), free_port()
    redis_url = start_private_redis(directory, processes)
    use_throwaway_portal(
        directory, redis_url, label="batch-bench",
        GATEWAY_BATCH_SHARE=str(args.share), BATCH_CONCURRENCY=str(args.batch_concurrency),
        BATCH_RETRY_S="0.2", GATEWAY_QUEUE_TIMEOUT_S="120", GATEWAY_BATCH_QUEUE_TIMEOUT_S="600",
    )  # fmt: skip
    sim = start(
        ["-m", "inference.sim", "--model", "llama-2-7b-chat-hf", "--served-model-name", MODEL,
         "--dtype", "float16", "--max-model-len", "4096", "--max-num-seqs", "64",
         "--speedup", str(args.speedup), "--port", str(sim_port), "--uvicorn-log-level", "warning"],
        stdout=log_file(directory, "sim"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    processes.append(sim)
    sim_url = f"http://127.0.0.1:{sim_port}"
    wait_for_http(f"{sim_url}/health", watch=sim, timeout_s=60)
    team, deployment = adopted_endpoint(
        upstream=sim_url, model=MODEL, config="llama-2-7b-chat-hf", name="batch-bench",
        team={"name": "Batch bench", "slug": "batch-bench"},
    )  # fmt: skip
    from portal.deployments.services import deployment_set_concurrency_cap
    from portal.teams.models import PriorityClass
    from portal.teams.services import api_key_create

    deployment_set_concurrency_cap(deployment=deployment, cap=args.cap, source="batch bench")
    _key, interactive = api_key_create(team=team, name="interactive", allowed_models=[MODEL])
    batch_key, _token = api_key_create(
        team=team, name="batch", allowed_models=[MODEL], priority_class=PriorityClass.BATCH
    )
    gateway = start(
        ["-m", "uvicorn", "portal.asgi:application", "--host", "127.0.0.1", "--port", str(gateway_port),
         "--loop", "uvloop", "--http", "httptools", "--no-access-log", "--log-level", "warning"],
        stdout=log_file(directory, "gateway"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    processes.append(gateway)
    url = f"http://127.0.0.1:{gateway_port}"
    wait_for_http(f"{url}/v1/models", watch=gateway, timeout_s=60)
    return url, interactive, str(batch_key.pk)


def batch_submit(key_id: str, args, round_: int) -> int:
    """A validated `--lines`-line batch of the batch key, in progress; its row id."""
    from portal.batches.lifecycle import batch_validate
    from portal.batches.services import batch_create, file_create
    from portal.celery import app
    from portal.teams.models import ApiKey

    key = ApiKey.objects.get(pk=key_id)
    lines = [
        {"custom_id": f"r{round_}-{n}", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": MODEL, "messages": [{"role": "user", "content": f"Summarise item {n}."}],
                  "max_tokens": args.max_tokens}}
        for n in range(args.lines)
    ]  # fmt: skip
    content = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
    file = file_create(team=key.team, filename=f"bench-{round_}.jsonl", content=content, purpose="batch")
    # This world runs tasks inline (CELERY_TASK_ALWAYS_EAGER): creating the batch would validate it
    # inline, and validation sends the run as it commits, which would take the whole batch here,
    # before the bench's clock. The bench validates here and runs the batch in a process of its own
    # (`--run-batch`), so those messages go to the broker that no worker reads.
    eager, app.conf.task_always_eager = app.conf.task_always_eager, False
    try:
        batch = batch_create(
            team=key.team, api_key=key, input_file_id=file.public_id, endpoint="/v1/chat/completions",
            completion_window="24h",
        )  # fmt: skip
        batch_validate(batch_id=batch.pk)
    finally:
        app.conf.task_always_eager = eager
    return batch.pk


def lines_finished_between(batch_id: int, start_at: float, end_at: float) -> tuple[int, float]:
    """(lines finished in the window, their rate: over the window, or until the batch's last line
    when it ended sooner)."""
    import datetime as dt

    from django.db.models import Max

    from portal.batches.models import BatchLine

    since, until = (dt.datetime.fromtimestamp(t, tz=dt.UTC) for t in (start_at, end_at))
    rows = BatchLine.objects.filter(batch_id=batch_id, finished_at__gte=since, finished_at__lt=until)
    done = rows.count()
    pending = BatchLine.objects.filter(batch_id=batch_id, state__in=["pending", "running"]).exists()
    last = rows.aggregate(last=Max("finished_at"))["last"]
    span = end_at - start_at if pending or last is None else max(1e-3, last.timestamp() - start_at)
    return done, done / span


def arrival_offsets(args, seed: int) -> list[float]:
    rng = random.Random(seed)  # noqa: S311 (a reproducible schedule, not a secret)
    offsets: list[float] = []
    t = 0.0
    while True:
        t += rng.expovariate(args.interactive_rate)
        if t >= args.duration:
            return offsets
        offsets.append(t)


async def interactive(url: str, token: str, args, offsets: list[float]) -> dict:
    """The seeded schedule of streamed interactive requests; their TTFTs."""
    import aiohttp

    from inference.loadgen.client import RequestInput, completion_body, stream_request
    from inference.loadgen.summary import percentile

    body = json.dumps(
        completion_body(MODEL, "Say something.", max_tokens=args.max_tokens, chat=True)
    ).encode()
    request = RequestInput(
        url=f"{url}/v1/chat/completions", body=body, headers={"Authorization": f"Bearer {token}"},
        timeout_s=600, expected_output_tokens=args.max_tokens,
    )  # fmt: skip
    records = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        loop = asyncio.get_running_loop()
        zero = loop.time()

        async def one(at: float) -> None:
            await asyncio.sleep(max(0.0, zero + at - loop.time()))
            records.append(await stream_request(session, request))

        await asyncio.gather(*[one(t) for t in offsets])
    ttfts = [r.ttft * 1000 for r in records if r.ok]
    nan = float("nan")
    return {
        "interactive_requests": len(ttfts),
        "interactive_errors": len(records) - len(ttfts),
        "ttft_p50_ms": percentile(ttfts, 50) if ttfts else nan,
        "ttft_p95_ms": percentile(ttfts, 95) if ttfts else nan,
    }


def run_round(url: str, token: str, key_id: str, args, round_: int, directory: Path) -> dict[str, dict]:
    offsets = arrival_offsets(args, args.seed + round_)
    alone = asyncio.run(interactive(url, token, args, offsets))
    alone |= {"batch_lines": 0, "batch_lines_s": 0.0}
    batch_id = batch_submit(key_id, args, round_)
    runner = start(
        ["-m", "perf.batch_spare_capacity", "--run-batch", str(batch_id)],
        stdout=log_file(directory, f"runner-{round_}"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        time.sleep(BATCH_LEAD_S)
        began = time.time()
        mixed = asyncio.run(interactive(url, token, args, offsets))
        ended = time.time()
    finally:
        from portal.batches.models import Batch
        from portal.batches.services import batch_cancel

        batch = Batch.objects.get(pk=batch_id)
        if batch.status == "in_progress":
            batch_cancel(batch=batch)
        try:
            runner.wait(timeout=60)
        except subprocess.TimeoutExpired:
            stop(runner)
    done, rate = lines_finished_between(batch_id, began, ended)
    mixed |= {"batch_lines": done, "batch_lines_s": rate}
    return {"alone": alone, "with batch": mixed}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=2000, help="lines in each round's batch")
    parser.add_argument("--cap", type=int, default=16, help="the deployment's gateway concurrency cap")
    parser.add_argument("--share", type=float, default=0.5, help="GATEWAY_BATCH_SHARE (0 < share ≤ 1)")
    parser.add_argument("--interactive-rate", type=float, default=4.0, help="interactive requests per second")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds per phase")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--speedup", type=float, default=20.0, help="the simulator's speed-up over a V100")
    parser.add_argument("--batch-concurrency", type=int, default=16, help="BATCH_CONCURRENCY of the runner")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", help="write every round and the medians here")
    parser.add_argument(
        "--check", action="store_true", help=f"exit 1 if the P50 ratio exceeds {TARGET_RATIO}"
    )
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory (logs, database)")
    parser.add_argument("--run-batch", type=int, help=argparse.SUPPRESS)  # the child: run this batch
    args = parser.parse_args()
    if args.run_batch is not None:
        import django

        django.setup()
        from portal.batches.runner import batch_run

        print(batch_run(batch_id=args.run_batch), flush=True)
        return 0
    _check_args(parser, args)
    ratio = float("nan")
    with scratch("batch bench", keep=args.keep) as (directory, processes):
        print(f"batch bench: setting up in {directory}", flush=True)
        url, token, key_id = build_world(processes, directory, args)
        asyncio.run(interactive(url, token, args, [0.1, 0.2]))  # warm up
        rounds = []
        for round_ in range(args.rounds):
            result = run_round(url, token, key_id, args, round_, directory)
            rounds.append(result)
            for name, r in result.items():
                print(
                    f"  round {round_ + 1} {name:<10} TTFT P50 {r['ttft_p50_ms']:7.1f} ms "
                    f"P95 {r['ttft_p95_ms']:7.1f} ms  batch {r['batch_lines']} lines "
                    f"({r['batch_lines_s']:.1f}/s)  errors {r['interactive_errors']}",
                    flush=True,
                )
        ratio = print_table(rounds, args)
        if args.json:
            Path(args.json).write_text(
                json.dumps({"config": vars(args), "rounds": rounds, "p50_ratio": ratio}, indent=2) + "\n"
            )
    return 1 if args.check and not ratio <= TARGET_RATIO else 0


def _check_args(parser: argparse.ArgumentParser, args) -> None:
    if not 1 <= args.lines <= 100_000:
        parser.error("--lines: between 1 and 100000")
    if not 1 <= args.cap <= 1024 or not 1 <= args.batch_concurrency <= 1024:
        parser.error("--cap, --batch-concurrency: between 1 and 1024")
    if not 0 < args.share <= 1:
        parser.error("--share: above 0 and at most 1")
    if not 0 < args.interactive_rate <= 1000:
        parser.error("--interactive-rate: above 0 and at most 1000 per second")
    if not 0 < args.duration <= 3600 or not 1 <= args.rounds <= 100:
        parser.error("--duration: above 0 and at most 3600 seconds; --rounds: between 1 and 100")
    if not 1 <= args.max_tokens <= 4096 or not 0 < args.speedup <= 1000:
        parser.error("--max-tokens: between 1 and 4096; --speedup: above 0 and at most 1000")


def print_table(rounds: list[dict[str, dict]], args) -> float:
    """The medians side by side; returns interactive P50 with the batch ÷ alone."""

    def med(name: str, metric: str) -> float:
        return statistics.median(r[name][metric] for r in rounds)

    alone = med("alone", "ttft_p50_ms")
    rows = [
        [f"interactive {name}", f"{med(name, 'ttft_p50_ms'):.1f}", f"{med(name, 'ttft_p95_ms'):.1f}",
         f"{med(name, 'ttft_p50_ms') / alone:.2f}", f"{med(name, 'batch_lines_s'):.1f}"]
        for name in ("alone", "with batch")
    ]  # fmt: skip
    ratio = med("with batch", "ttft_p50_ms") / alone
    print()
    print(
        f"Batch on spare capacity: {args.lines}-line batch, cap {args.cap}, batch share {args.share:g}, "
        f"interactive {args.interactive_rate:g}/s (Poisson), max_tokens {args.max_tokens}, sim speedup "
        f"{args.speedup:g}, {args.duration:g} s per phase, median of {args.rounds} rounds"
    )
    print(table(["phase", "TTFT P50 ms", "TTFT P95 ms", "P50 ÷ alone", "batch lines/s"], rows))
    verdict = "met" if ratio <= TARGET_RATIO else "MISSED"
    print(f"goal: interactive P50 with the batch ≤ {TARGET_RATIO:.2f} × alone: {ratio:.3f} ({verdict})")
    return ratio


if __name__ == "__main__":
    sys.exit(main())
