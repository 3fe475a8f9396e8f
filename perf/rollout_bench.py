"""The rollout benchmark: steady streamed load through the gateway during a full rollout (promoted)
and during one that breaks the SLA (rolled back on its own).

    .venv/bin/python -m perf.rollout_bench [--clients 4] [--max-tokens 8] [--steps 25x30s,50x30s,100x30s]
        [--interval-s 10] [--min-requests 10] [--bucket-s 60] [--slow-speedup 0.05] [--promotions 1]
        [--json out.json]

A throwaway world on 127.0.0.1 in a temporary directory (the machine's PostgreSQL and Redis are not
touched): a migrated SQLite portal, a private `redis-server`, a gateway process (uvicorn, routes and
shares cached one second), and three simulated V100 7B servers (`python -m inference.sim`): the old
version, a good new one, and a bad new one whose clock runs `--slow-speedup` times as fast (its
tokens come 20× slower: it breaks the TPOT SLA). The rollouts are driven by the control task's own
code (`rollouts_advance_all`, what beat runs on the `control` queue) once a second in this process.

Each scenario sends `--clients` closed-loop streaming clients at one served name and starts a
rollout once the load runs. It prints, per scenario: requests, failures (any non-200, error chunk or
stream cut before `[DONE]`), and per `--bucket-s` (a minute by default) each version's requests and
P95 TTFT (measured by the client), the new version's share as set (lowest–highest in the bucket)
and as served; for the roll-back, how long after the breach began (the step that first gave the bad
version traffic) its share was back at 0, and when the last request reached it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from devtools import free_port, wait_for_http
from perf._common import scratch, start, table
from perf._world import log_file, start_private_redis, use_throwaway_portal
from perf.rollout_load import Outcome, SteadyLoad, p95, spawn_sim

STEP_TEXT = re.compile(r"^\s*(\d{1,3})\s*x\s*(\d{1,5})s\s*$")
SLA_TTFT_S = 5.0
SLA_TPOT_S = 0.15  # a simulated V100 7B makes a token every ~20 ms; at 0.05× speed every ~400 ms


@dataclass
class Shares:
    """The new version's share as set, sampled once a second: (time, percent)."""

    samples: list[tuple[float, float]] = field(default_factory=list)


@dataclass
class Scenario:
    name: str
    served: str
    old: str
    new: str
    outcomes: list[Outcome]
    shares: Shares
    state: str
    reason: str
    step_started: float  # when the new version first got a share
    finished: float
    interval_s: int = 0


def parse_steps(text: str) -> list[dict]:
    steps = []
    for part in text.split(","):
        found = STEP_TEXT.match(part)
        if found is None:
            raise SystemExit(f"--steps: “{part}” is not share x seconds (e.g. 25x30s)")
        steps.append({"share_percent": int(found[1]), "seconds": int(found[2])})
    return steps


def build_portal(directory: Path, sims: dict[str, str], promotions: int = 1) -> tuple[str, dict]:
    """Migrate; a team, a key for the served names, a node, one deployment per simulated version
    (with release hashes and the bench's SLA). Returns the key and version name → deployment."""
    import django

    django.setup()
    from django.core.management import call_command
    from django.db import connection

    call_command("migrate", verbosity=0)
    with connection.cursor() as cursor:
        cursor.execute("PRAGMA journal_mode=WAL")  # this process writes while the gateway reads

    from inference.hf_config import known_configs
    from portal.deployments.models import Deployment, DeploymentProfile
    from portal.inventory.services import node_create
    from portal.registry.models import ModelVersion
    from portal.registry.services import model_version_create, served_model_create
    from portal.teams.models import Team
    from portal.teams.services import api_key_create

    team = Team.objects.create(name="Rollout bench", slug="rollout-bench", gpu_quota=8)
    node = node_create(name="bench-node", hostname="127.0.0.1")
    config = json.loads(known_configs()["llama-2-7b-chat-hf"].read_text())
    deployments = {}
    for name, url in sims.items():
        version = model_version_create(name=name, config=config)
        ModelVersion.objects.filter(pk=version.pk).update(weights_sha256="b" * 64, tokenizer_sha256="c" * 64)
        version.refresh_from_db()  # a rollout moves traffic only to a version with release hashes
        deployments[name] = Deployment.objects.create(
            name=f"d-{name}", team=team, model_version=version, node=node, desired_state="running",
            profile=DeploymentProfile.objects.create(name=f"p-{name}", model_version=version),
            state="serving", endpoint_url=url, sla_p95_ttft_s=SLA_TTFT_S, sla_p95_tpot_s=SLA_TPOT_S,
        )  # fmt: skip
    names = [promote_name(i) for i in range(promotions)] + ["chat-rollback"]
    for name in names:
        served_model_create(name=name, shares={"v1": 10_000})
    _, token = api_key_create(team=team, name="bench", allowed_models=names)
    return token, deployments


def promote_name(index: int) -> str:
    return "chat-promote" if index == 0 else f"chat-promote-{index + 1}"


def serve_again(deployment) -> None:
    """After a promotion the old deployment was asked to stop; with no agent here it still runs, and
    the next repetition needs it serving again (as an operator's restart would leave it)."""
    from portal.deployments.models import Deployment

    Deployment.objects.filter(pk=deployment.pk).update(desired_state="running", state="serving")


class ControlLoop:
    """The control task's code once a second (as beat with ROLLOUT_TICK_S=1), sampling the share."""

    def __init__(self) -> None:
        self.watch: tuple[str, str] | None = None  # (served name, new version)
        self.shares = Shares()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> ControlLoop:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        from django.db import close_old_connections

        from portal.registry.models import ServedModelVersion
        from portal.rollouts.services import rollouts_advance_all

        while not self._stop.is_set():
            close_old_connections()
            rollouts_advance_all()
            if self.watch is not None:
                served, new = self.watch
                share = ServedModelVersion.objects.filter(
                    served_model__name=served, model_version__name=new
                ).values_list("share_bp", flat=True)
                self.shares.samples.append((time.time(), (share.first() or 0) / 100))
            self._stop.wait(1.0)


def run_scenario(name: str, *, served: str, new: str, control: ControlLoop, gateway: str, token: str,
                 deployments: dict, args) -> Scenario:  # fmt: skip
    from portal.registry.models import ServedModel
    from portal.rollouts.models import Rollout
    from portal.rollouts.services import rollout_start

    control.watch, control.shares = (served, new), Shares()
    load = SteadyLoad(gateway, token, served, clients=args.clients, max_tokens=args.max_tokens).start()
    deadline = time.monotonic() + 60
    while load.count() < args.clients * 2:  # the old version serves the load first
        if time.monotonic() > deadline:
            raise SystemExit(f"{name}: no answers through the gateway")
        time.sleep(0.2)
    lead_in = time.time()
    rollout = rollout_start(
        served_model=ServedModel.objects.get(name=served), to_deployment=deployments[new],
        from_deployment=deployments["v1"], steps=parse_steps(args.steps), interval_s=args.interval_s,
        min_requests=args.min_requests,
    )  # fmt: skip
    total_s = sum(s["seconds"] for s in parse_steps(args.steps))
    deadline = time.monotonic() + 3 * total_s + 120
    while True:
        rollout = Rollout.objects.get(pk=rollout.pk)
        if not rollout.is_active:
            break
        if time.monotonic() > deadline:
            raise SystemExit(f"{name}: rollout still {rollout.state} at step {rollout.current_step}")
        time.sleep(0.5)
    finished = rollout.finished_at.timestamp()
    first_step = rollout.events.filter(kind="step").order_by("at").first()
    while time.time() < finished + args.tail_s:  # the load goes on after the verdict
        time.sleep(0.5)
    outcomes = load.stop()
    return Scenario(
        name, served, "v1", new, [o for o in outcomes if o.started >= lead_in - args.tail_s], control.shares,
        rollout.state, rollout.reason, first_step.at.timestamp() if first_step else finished, finished,
        args.interval_s,
    )  # fmt: skip


def _fmt_ms(value: float | None) -> str:
    return "—" if value is None else f"{value:.0f}"


def report(scenario: Scenario, bucket_s: int) -> dict:
    outcomes = scenario.outcomes
    begin = min(o.started for o in outcomes)
    failures = [o for o in outcomes if not o.ok]
    rows, buckets = [], []
    count = int((max(o.started for o in outcomes) - begin) // bucket_s) + 1
    for index in range(count):
        low, high = begin + index * bucket_s, begin + (index + 1) * bucket_s
        mine = [o for o in outcomes if low <= o.started < high]
        by = {v: [o for o in mine if o.version == v] for v in (scenario.old, scenario.new)}
        set_shares = [p for t, p in scenario.shares.samples if low <= t < high]
        served_new = len(by[scenario.new]) / len(mine) * 100 if mine else 0.0
        bucket = {
            "from_s": round(low - begin),
            "requests": len(mine),
            "failures": sum(1 for o in mine if not o.ok),
            "old_requests": len(by[scenario.old]),
            "old_p95_ttft_ms": p95([o.ttft_ms for o in by[scenario.old] if o.ttft_ms is not None]),
            "new_requests": len(by[scenario.new]),
            "new_p95_ttft_ms": p95([o.ttft_ms for o in by[scenario.new] if o.ttft_ms is not None]),
            "share_set": [min(set_shares), max(set_shares)] if set_shares else None,
            "share_served": round(served_new, 1),
        }
        buckets.append(bucket)
        share = bucket["share_set"]
        rows.append([
            f"{bucket['from_s']}–{bucket['from_s'] + bucket_s} s",
            str(bucket["requests"]), str(bucket["failures"]),
            f"{bucket['old_requests']} / {_fmt_ms(bucket['old_p95_ttft_ms'])}",
            f"{bucket['new_requests']} / {_fmt_ms(bucket['new_p95_ttft_ms'])}",
            "—" if share is None else f"{share[0]:g}–{share[1]:g} %", f"{served_new:.0f} %",
        ])  # fmt: skip
    summary = {
        "scenario": scenario.name,
        "state": scenario.state,
        "requests": len(outcomes),
        "failures": len(failures),
        "failure_examples": [o.error for o in failures[:3]],
        "buckets": buckets,
        "reason": scenario.reason,
    }
    print(f"\n## {scenario.name}: {scenario.old} → {scenario.new} on {scenario.served}: {scenario.state}")
    print(
        f"requests {len(outcomes)}, failures {len(failures)}"
        + (f" ({failures[0].error})" if failures else "")
    )
    print(
        table(
            ["window", "requests", "failures", f"{scenario.old} (old): n / P95 TTFT ms",
             f"{scenario.new} (new): n / P95 TTFT ms", "new share set", "new share served"],
            rows,
        )
    )  # fmt: skip
    if scenario.state == "rolled_back":
        zero_at = next((t for t, p in scenario.shares.samples if t >= scenario.step_started and p == 0), None)
        last_new = max((o.started for o in outcomes if o.version == scenario.new), default=None)
        summary["share_zero_after_breach_s"] = round(scenario.finished - scenario.step_started, 1)
        summary["share_zero_sampled_after_s"] = (
            None if zero_at is None else round(zero_at - scenario.step_started, 1)
        )
        summary["last_request_to_new_after_breach_s"] = (
            None if last_new is None else round(last_new - scenario.step_started, 1)
        )
        print(
            f"breach began (the bad version's first step) → share back at 0: "
            f"{summary['share_zero_after_breach_s']} s (measurement interval {scenario.interval_s} s); "
            f"the last request reached it {summary['last_request_to_new_after_breach_s']} s "
            "after the breach began"
        )
        print(f"why: {scenario.reason}")
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--steps", default="25x30s,50x30s,100x30s", help="share x seconds, comma separated")
    parser.add_argument("--interval-s", type=int, default=10, help="the rollout's measurement interval")
    parser.add_argument("--min-requests", type=int, default=10)
    parser.add_argument("--bucket-s", type=int, default=60, help="the report's window (a minute)")
    parser.add_argument("--tail-s", type=float, default=5, help="load kept on after the verdict")
    parser.add_argument("--slow-speedup", type=float, default=0.05, help="the bad version's clock speed")
    parser.add_argument(
        "--promotions",
        type=int,
        default=1,
        choices=range(1, 21),
        metavar="1..20",
        help="rollouts to an identical version, one after another (each must be promoted)",
    )
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    parse_steps(args.steps)

    # The control loop stops first (the exit stack is left first), then the processes.
    with scratch("rollout bench") as (directory, processes), contextlib.ExitStack() as stops:
        print(f"setting up in {directory}")
        redis_url = start_private_redis(directory, processes)
        use_throwaway_portal(directory, redis_url, label="rollout-bench", GATEWAY_CACHE_S="1",
                             CELERY_TASK_ALWAYS_EAGER="false")  # fmt: skip
        sims = {}
        for name, speedup in (("v1", 1.0), ("v2-good", 1.0), ("v2-slow", args.slow_speedup)):
            sims[name], process = spawn_sim(name, directory / f"sim-{name}.log", speedup=speedup)
            processes.append(process)
        token, deployments = build_portal(directory, sims, args.promotions)
        port = free_port()
        gateway = start(
            ["-m", "uvicorn", "portal.asgi:application", "--host", "127.0.0.1", "--port", str(port),
             "--loop", "uvloop", "--http", "httptools", "--no-access-log", "--log-level", "warning"],
            stdout=log_file(directory, "gateway"), stderr=subprocess.STDOUT,
        )  # fmt: skip
        processes.append(gateway)
        url = f"http://127.0.0.1:{port}"
        wait_for_http(f"{url}/v1/models", watch=gateway, timeout_s=60)
        control = ControlLoop().start()
        stops.callback(control.stop)
        results = []
        plan = [(f"promotion {i + 1} (identical version)", promote_name(i), "v2-good")
                for i in range(args.promotions)]  # fmt: skip
        plan.append(("automatic roll-back", "chat-rollback", "v2-slow"))
        for name, served, new in plan:
            scenario = run_scenario(name, served=served, new=new, control=control, gateway=url, token=token,
                                    deployments=deployments, args=args)  # fmt: skip
            results.append(report(scenario, args.bucket_s))
            serve_again(deployments["v1"])
        print("\noutcomes: " + ", ".join(f"{r['scenario']}: {r['state']}" for r in results))
        print(
            f"\nsteps {args.steps}, measured every {args.interval_s} s, {args.clients} clients, "
            f"{args.max_tokens} tokens each, SLA P95 TTFT {SLA_TTFT_S:g} s / TPOT {SLA_TPOT_S * 1000:g} ms"
        )
        if args.json is not None:
            report_json = {"args": {**vars(args), "json": str(args.json)}, "results": results}
            args.json.write_text(json.dumps(report_json, indent=2, default=str))


if __name__ == "__main__":
    main()
