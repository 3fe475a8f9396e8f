"""A fleet of 100 nodes: supervision fan-out, page costs, routing refresh and Redis memory at fleet size.

    .venv/bin/python -m perf.fleet [--nodes 100] [--per-node 2] [--ticks 3] [--inflight 2000] [--json f]

A throwaway world on 127.0.0.1, in a temporary directory: a SQLite database
(migrated) and a private `redis-server` (the machine's PostgreSQL and Redis are
not touched). `--nodes` nodes of 8 × V100-SXM2-32GB (registered through
`node_create` and `node_apply_nvidia_smi_text`, the bundled nvidia-smi sample),
each with `--per-node` serving deployments of Llama-2-7B on its own GPUs. The
deployments are rows only: no server runs, so the measurements are the
portal's own work at that size, not vLLM's.

- Supervision: one Celery worker (`--pool threads`) consumes every node's own
  `node.<name>` queue (one process standing in for 100 agents). Its
  `node_supervise` reads the node's deployments as the real one does, then
  records the node as checked instead of touching processes. The real beat
  task `deployments.supervise_all` sends each tick; measured: how long the
  task takes, and how long until every node's pass has run, against
  DEPLOYMENT_SUPERVISE_INTERVAL_S.
- Pages: the dashboard, `/nodes/` and `/deployments/` as a staff user (Django's
  test client, in process): queries and render time at 3 nodes and at
  `--nodes`; the query count must not change.
- Routing: the gateway's route load for the model (`portal.gateway.routing._load_route`),
  all deployments serving it: the refresh each process does every GATEWAY_CACHE_S.
- Redis: `--inflight` requests admitted and placed through `RateLimiter.admit_and_place`
  (team and key quotas all set, spread over every deployment) and not finished;
  `used_memory` and the key count before and after.

Prints one table (metric, value, target, ok); exit code 1 if a target is missed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

from devtools import free_port
from perf._common import scratch, spawn, start, table, wait_redis

MODEL = "llama-2-7b-chat-hf"
PAGES = ("/", "/nodes/", "/deployments/")
CHECKED = "bench-fleet:checked"  # the simulated supervise's record: a hash node -> tick


# --- the fleet (also used by tests, inside their own database) ------------------------------------------


def build_fleet(*, first: int, count: int, per_node: int = 2, prefix: str = "fleet") -> list[str]:
    """`count` nodes of 8 V100s (names `<prefix>-NNN` from `first`), each with `per_node` serving
    deployments of the 7B model splitting its GPUs; the model and a team are created once."""
    from inference.hf_config import known_configs
    from portal.deployments.models import Deployment
    from portal.inventory.services import node_apply_nvidia_smi_text, node_create
    from portal.registry.models import ModelVersion
    from portal.registry.services import model_version_create
    from portal.teams.models import Team

    version = ModelVersion.objects.filter(name=MODEL).first() or model_version_create(
        name=MODEL, config=json.loads(known_configs()[MODEL].read_text())
    )
    team, _ = Team.objects.get_or_create(slug=f"{prefix}-team", defaults={"name": f"{prefix} team"})
    samples = Path(__file__).resolve().parents[1] / "inference" / "data" / "nvidia_smi"
    query = (samples / "v100_sxm2_8x_query.csv").read_text()
    topology = (samples / "v100_sxm2_8x_topo.txt").read_text()
    gpus_each = 8 // per_node
    names = []
    for i in range(first, first + count):
        node = node_create(name=f"{prefix}-{i:03d}")
        node_apply_nvidia_smi_text(node=node, query_csv=query, topology_text=topology)
        names.append(node.name)
        Deployment.objects.bulk_create(
            Deployment(
                name=f"{node.name}-d{j}", team=team, model_version=version, node=node,
                gpu_indices=list(range(j * gpus_each, (j + 1) * gpus_each)), shared=True,
                desired_state="running", state="serving", concurrency_cap=64,
                endpoint_url=f"http://127.0.0.1:{20000 + i * per_node + j}",
            )
            for j in range(per_node)
        )  # fmt: skip
    return names


def page_costs(client, paths=PAGES) -> dict[str, tuple[int, float]]:
    """Per path: (queries, render ms) of one GET (after one warm-up GET), as the logged-in client."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    costs = {}
    for path in paths:
        client.get(path)
        with CaptureQueriesContext(connection) as queries:
            t0 = time.perf_counter()
            response = client.get(path)
            ms = (time.perf_counter() - t0) * 1000
        if response.status_code != 200:
            raise SystemExit(f"{path}: HTTP {response.status_code}")
        costs[path] = (len(queries), ms)
    return costs


# --- the worker standing in for 100 agents ----------------------------------------------------------------


def worker_main(queues: str, concurrency: int) -> None:
    """A Celery worker on `queues` whose node_supervise reads the node's deployments and records it."""
    import django

    django.setup()
    from portal.core.redis.client import gateway_redis
    from portal.deployments.agent import supervise
    from portal.deployments.models import Deployment

    def node_supervise(node_name: str, *, owner: str) -> dict[str, str]:
        # The real pass's read (agent.supervise.node_supervise); the per-deployment process checks are what
        # a real agent does on its own host, in parallel with every other node's.
        rows = dict(Deployment.objects.filter(node__name=node_name, adopted=False).values_list("pk", "name"))
        gateway_redis().hset(CHECKED, node_name, time.time())
        return {name: "simulated" for name in rows.values()}

    supervise.node_supervise = node_supervise
    from portal.celery import app

    app.worker_main(["worker", "-Q", queues, "--pool", "threads", "--concurrency", str(concurrency),
                     "--loglevel", "WARNING", "--without-gossip", "--without-mingle", "--without-heartbeat",
                     "-n", f"fleet-{os.getpid()}@%h"])  # fmt: skip


# --- measurements ------------------------------------------------------------------------------------------


def supervision(names: list[str], ticks: int, interval_s: float) -> dict:
    """Run the beat task `ticks` times; per tick: its own duration and until every node was checked."""
    from portal.core.redis.client import gateway_redis
    from portal.deployments.tasks import supervise_all

    redis = gateway_redis()
    task_ms, all_checked_s = [], []
    for _ in range(ticks):
        redis.delete(CHECKED)
        t0 = time.time()
        sent = supervise_all()
        task_ms.append((time.time() - t0) * 1000)
        if sent != len(names):
            raise SystemExit(f"supervise_all sent {sent} passes for {len(names)} nodes")
        deadline = time.monotonic() + interval_s * 4
        while redis.hlen(CHECKED) < len(names):
            if time.monotonic() > deadline:
                checked = redis.hlen(CHECKED)
                raise SystemExit(f"only {checked} of {len(names)} nodes checked in {interval_s * 4} s")
            time.sleep(0.02)
        all_checked_s.append(max(float(v) for v in redis.hvals(CHECKED)) - t0)
        # The next tick starts at its interval in production; here at once, the worker idle again.
    return {"task_ms": max(task_ms), "all_checked_s": max(all_checked_s), "ticks": ticks}


def routing_refresh(repeat: int = 5) -> dict:
    from django.db import reset_queries

    from portal.gateway.routing import _load_route

    times = []
    for _ in range(repeat):
        reset_queries()
        t0 = time.perf_counter()
        route = _load_route(MODEL)
        times.append((time.perf_counter() - t0) * 1000)
    return {"ms": statistics.median(times), "replicas": len(route.replicas)}


def redis_memory(inflight: int, redis_url: str) -> dict:
    """Admit `inflight` requests over every deployment, kept in flight; memory and keys before and after."""
    import redis.asyncio as aioredis

    from portal.core.redis.client import redis_keys
    from portal.deployments.models import Deployment
    from portal.gateway.admission.limiter import RateLimiter
    from portal.gateway.admission.records import Limits, Scope

    replicas = [(pk, 64) for pk in Deployment.objects.order_by("pk").values_list("pk", flat=True)]
    limits = Limits(rpm=10**7, tpm=10**9, tokens_per_day=10**12, max_concurrent=10**5)
    scopes = [(Scope("team", t, limits), Scope("key", 1000 + t, limits)) for t in range(10)]

    async def run() -> dict:
        client = aioredis.Redis.from_url(redis_url)
        limiter = RateLimiter(client, keys=redis_keys(), lease_ms=60_000)
        before_mem, before_keys = (await client.info("memory"))["used_memory"], await client.dbsize()
        for i in range(inflight):
            team, key = scopes[i % len(scopes)]
            admission, placement = await limiter.admit_and_place(
                request_id=uuid.uuid4().hex, team=team, key=key, tokens=512, model=MODEL,
                candidates=[replicas[i % len(replicas)]],
            )  # fmt: skip
            if not admission.ok or placement is None or placement.index is None:
                raise SystemExit(f"request {i} not admitted: {admission} {placement}")
        after_mem, after_keys = (await client.info("memory"))["used_memory"], await client.dbsize()
        await client.aclose()
        return {"bytes": after_mem - before_mem, "keys": after_keys - before_keys}

    found = asyncio.run(run())
    return {
        "inflight": inflight,
        "keys": found["keys"],
        "bytes_per_request": found["bytes"] / inflight,
        "bytes_per_key": found["bytes"] / max(found["keys"], 1),
    }


# --- the run --------------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nodes", type=int, default=100)
    p.add_argument("--per-node", type=int, default=2, choices=(1, 2, 4, 8))
    p.add_argument("--ticks", type=int, default=3)
    p.add_argument("--inflight", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=4, help="the worker's threads")
    p.add_argument("--json", type=Path)
    p.add_argument("--worker", help=argparse.SUPPRESS)  # internal: the worker on these queues
    args = p.parse_args(argv)
    if not 3 <= args.nodes <= 1000:
        p.error("--nodes must be 3 to 1000")
    if not 1 <= args.ticks <= 20 or not 1 <= args.inflight <= 100_000:
        p.error("--ticks must be 1 to 20 and --inflight 1 to 100000")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker_main(args.worker, args.concurrency)
        return 0
    if shutil.which("redis-server") is None:
        raise SystemExit("redis-server is not installed: the fleet bench runs its own private Redis")
    with scratch("bench fleet") as (directory, processes):
        print(f"setting up in {directory}", flush=True)
        return run(args, directory, processes)


def run(args, directory: Path, processes: list[subprocess.Popen]) -> int:
    port = free_port()
    processes.append(
        spawn(["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no",
               "--dir", str(directory)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    )  # fmt: skip
    redis_url = f"redis://127.0.0.1:{port}/0"
    os.environ.update(
        {
            "DJANGO_SETTINGS_MODULE": "portal.settings",
            "DATABASE_URL": f"sqlite:///{directory / 'portal.sqlite3'}",
            "REDIS_URL": redis_url,
            "GATEWAY_REDIS_URL": redis_url,
            "CELERY_BROKER_URL": f"redis://127.0.0.1:{port}/1",
            "CELERY_RESULT_BACKEND": f"redis://127.0.0.1:{port}/1",
            "PORTAL_RUN_DIR": str(directory / "run"),
            "SECRET_KEY": "fleet-only-secret-key-0123456789abcdefghijklmnopqrstuvwxyz",
            "SECURE_SSL_REDIRECT": "false",
            "ALLOWED_HOSTS": "testserver,127.0.0.1",
            "DEBUG": "true",  # plain static files (no collected manifest in a throwaway world)
            "LOG_LEVEL": "WARNING",
        }
    )
    wait_redis(port, processes[0])
    import django

    django.setup()
    from django.conf import settings
    from django.contrib.auth import get_user_model
    from django.core.management import call_command
    from django.db import connection
    from django.test import Client

    call_command("migrate", verbosity=0)
    with connection.cursor() as cursor:
        cursor.execute("PRAGMA journal_mode=WAL")  # the worker reads while this process writes

    staff = get_user_model().objects.create_user("ops", is_staff=True)
    client = Client()
    client.force_login(staff)

    t0 = time.perf_counter()
    names = build_fleet(first=0, count=3, per_node=args.per_node)
    small = page_costs(client)
    names += build_fleet(first=3, count=args.nodes - 3, per_node=args.per_node)
    build_s = time.perf_counter() - t0
    large = page_costs(client)
    routing = routing_refresh()

    from portal.inventory.models import Node

    queues = ",".join(Node.objects.get(name=n).queue for n in names)
    log = open(directory / "worker.log", "wb")  # noqa: SIM115 (the worker keeps it open until it exits)
    worker = ["-m", "perf.fleet", "--worker", queues, "--concurrency", str(args.concurrency)]
    processes.append(start(worker, stdout=log, stderr=subprocess.STDOUT))
    interval = settings.DEPLOYMENT_SUPERVISE_INTERVAL_S
    _wait_worker(processes[-1], directory)
    fanout = supervision(names, args.ticks, interval)
    memory = redis_memory(args.inflight, redis_url)

    n, deployments = len(names), len(names) * args.per_node
    rows: list[tuple[str, str, str, bool]] = [
        (f"fleet registered ({n} nodes × 8 GPUs, {deployments} deployments)", f"{build_s:.1f} s", "", True),
        ("beat task supervise_all (sends the passes), slowest tick", f"{fanout['task_ms']:.0f} ms",
         f"≤ {interval * 1000 / 10:.0f} ms", fanout["task_ms"] <= interval * 100),
        (f"every node checked after the tick, slowest of {fanout['ticks']}",
         f"{fanout['all_checked_s']:.2f} s",
         f"≤ {interval / 2:g} s (half of {interval:g} s)", fanout["all_checked_s"] <= interval / 2),
    ]  # fmt: skip
    for path in PAGES:
        (q3, ms3), (qn, msn) = small[path], large[path]
        rows.append((f"{path} queries, 3 → {n} nodes", f"{q3} → {qn}", "same", q3 == qn))
        rows.append(
            (f"{path} render at {n} nodes (3 nodes)", f"{msn:.0f} ms ({ms3:.0f})", "≤ 1000 ms", msn <= 1000)
        )
    rows += [
        (f"routing table refresh, {routing['replicas']} replicas", f"{routing['ms']:.1f} ms",
         f"≤ {settings.GATEWAY_CACHE_S * 1000 / 20:.0f} ms", routing["ms"] <= settings.GATEWAY_CACHE_S * 50),
        (f"Redis memory per in-flight request ({memory['inflight']} in flight)",
         f"{memory['bytes_per_request']:.0f} B", "", True),
        (f"Redis memory per key ({memory['keys']} keys)", f"{memory['bytes_per_key']:.0f} B", "", True),
    ]  # fmt: skip
    cells = [(m, v, t, "yes" if ok else "NO") for m, v, t, ok in rows]
    print(table(("metric", "value", "target", "ok"), cells, left=(0, 2)))
    if args.json:
        args.json.write_text(json.dumps({
            "nodes": n, "deployments": deployments, "build_s": build_s, "supervision": fanout,
            "interval_s": interval, "pages": {p: {"small": small[p], "large": large[p]} for p in PAGES},
            "routing": routing, "redis": memory,
        }, indent=2))  # fmt: skip
    return 0 if all(ok for *_, ok in rows) else 1


def _wait_worker(process: subprocess.Popen, directory: Path) -> None:
    """Until the worker answers a ping (it consumes its queues from then on)."""
    from portal.celery import app

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit("the worker exited:\n" + (directory / "worker.log").read_text()[-3000:])
        if app.control.ping(timeout=0.5):
            return
    raise SystemExit("the worker did not come up")


if __name__ == "__main__":
    sys.exit(main())
