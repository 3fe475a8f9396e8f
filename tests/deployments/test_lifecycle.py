"""The node agent's lifecycle services against the stand-in engine (see conftest.py).

Every test here launches real processes in their own process groups and checks
real outcomes: pids, process groups, ports, log files, rows and timeline events.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
from pathlib import Path

import pytest
from django.db import connection
from django.utils import timezone

from devtools import wait_until
from inference import supervisor
from portal.deployments.agent.lease import LeaseLost, lease_acquire
from portal.deployments.agent.restart import deployment_restart
from portal.deployments.agent.start import deployment_start
from portal.deployments.agent.stop import deployment_stop
from portal.deployments.agent.supervise import deployment_supervise
from portal.deployments.models import Deployment, DesiredState
from portal.registry.services import model_version_create
from tests.helpers import builders
from tests.helpers.builders import cpu_node_with, make_deployment
from tests.helpers.samples import bundled_config
from tests.helpers.vllm_install import fake_vllm_install

pytestmark = pytest.mark.django_db


def _start(deployment, owner="test-agent"):
    result = deployment_start(deployment.pk, owner=owner)
    deployment.refresh_from_db()
    return result


def _steps(deployment) -> list[tuple[str, str]]:
    return [(e.step, e.status) for e in deployment.events.all()]


def _wait_dead(pid: int, timeout_s: float = 30) -> None:
    """Until a killed process is gone (SIGKILL is not instant on a loaded machine)."""
    wait_until(
        lambda: not supervisor.process_alive(pid),
        timeout_s=timeout_s,
        what=f"process {pid} gone",
        interval_s=0.02,
    )


@pytest.fixture
def deployment(team, tiny_version, tiny_profile, fake_node, reap_servers):
    return make_deployment(team, tiny_version, tiny_profile, fake_node)


def test_it_starts_a_server_and_reports_serving_with_its_endpoint(deployment):
    assert _start(deployment) == "serving"
    assert deployment.state == "serving"
    assert deployment.endpoint_url == f"http://127.0.0.1:{deployment.port}"
    assert supervisor.check_health(deployment.endpoint_url)
    assert supervisor.process_alive(deployment.pid)
    assert deployment.pgid == deployment.pid  # its own process group
    assert deployment.command[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert deployment.command[deployment.command.index("--served-model-name") + 1] == "tiny-llama"
    assert Path(deployment.log_path).read_text().startswith("INFO fake vLLM")


def test_it_records_every_step_on_the_timeline_in_order(deployment):
    _start(deployment)
    steps = [step for step, status in _steps(deployment) if status in ("ok", "failed")]
    assert steps == [
        "validate",
        "quota",
        "environment",
        "hashes",
        "address",
        "port",
        "command",
        "launch",
        "health",
        "ready",
        "warm-up",
        "smoke test",
        "serving",
    ]
    serving = deployment.events.get(step="serving")
    assert "from the request" in serving.message and "engine start-up" in serving.message


def test_it_is_a_no_op_to_start_a_serving_deployment_again(deployment):
    _start(deployment)
    pid = deployment.pid
    assert _start(deployment) == "already serving"
    assert deployment.pid == pid


def test_it_does_nothing_while_another_agent_holds_the_lease(deployment):
    lease = lease_acquire(deployment.pk, owner="someone-else")
    assert _start(deployment) == "busy"
    assert deployment.pid is None
    lease.release()


def test_it_fences_out_an_agent_whose_lease_was_taken_over(deployment):
    stale = lease_acquire(deployment.pk, owner="slow-agent")
    Deployment.objects.filter(pk=deployment.pk).update(lease_expires_at=timezone.now())
    fresh = lease_acquire(deployment.pk, owner="new-agent")
    assert fresh.token == stale.token + 1
    with pytest.raises(LeaseLost):
        stale.write(state="serving")
    fresh.write(state="starting")
    assert Deployment.objects.get(pk=deployment.pk).state == "starting"


def test_it_stops_the_whole_process_group_and_frees_the_port(deployment):
    _start(deployment)
    pgid, port = deployment.pgid, deployment.port
    assert len(supervisor.group_members(pgid)) >= 2  # the server and its engine child
    Deployment.objects.filter(pk=deployment.pk).update(desired_state=DesiredState.STOPPED)
    assert deployment_stop(deployment.pk, owner="test-agent") == "stopped"
    deployment.refresh_from_db()
    assert deployment.state == "stopped"
    assert supervisor.group_members(pgid) == []
    assert supervisor.port_is_free("127.0.0.1", port)
    assert deployment.endpoint_url == "" and deployment.pid is None
    stop = deployment.events.get(step="stop")
    assert f"process group {pgid} gone" in stop.message and f"port {port} free" in stop.message


def test_it_drains_in_flight_requests_before_stopping(deployment, run_dir, settings):
    settings.DEPLOYMENT_DRAIN_TIMEOUT_S = 1
    _start(deployment)
    (run_dir / deployment.name / "in_flight").write_text("2")
    Deployment.objects.filter(pk=deployment.pk).update(desired_state=DesiredState.STOPPED)
    deployment_stop(deployment.pk, owner="test-agent")
    drain = deployment.events.get(step="drain", status="ok")
    assert "2 requests still in flight at the 1 s deadline" in drain.message
    assert Deployment.objects.get(pk=deployment.pk).state == "stopped"


def test_it_keeps_the_port_across_restarts_and_moves_when_it_is_taken(deployment):
    _start(deployment)
    port = deployment.port
    Deployment.objects.filter(pk=deployment.pk).update(desired_state=DesiredState.STOPPED)
    deployment_stop(deployment.pk, owner="test-agent")
    Deployment.objects.filter(pk=deployment.pk).update(desired_state=DesiredState.RUNNING)
    with socket.socket() as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past the health checks' TIME_WAIT
        squatter.bind(("127.0.0.1", port))
        squatter.listen()
        assert _start(deployment) == "serving"
    assert deployment.port != port
    assert f"{port} is taken by another process" in deployment.events.filter(step="port").last().message


def test_it_fails_with_a_reason_when_the_vllm_environment_does_not_exist(
    team, tiny_version, tiny_profile, db
):
    node = cpu_node_with("broken-env", "/opt/nowhere/bin/python")
    deployment = make_deployment(team, tiny_version, tiny_profile, node)
    assert _start(deployment) == "failed"
    assert deployment.state == "failed"
    assert deployment.state_reason == "/opt/nowhere/bin/python does not exist on node broken-env"
    assert deployment.pid is None


def test_it_refuses_a_model_directory_with_missing_files(deployment, tiny_model_dir, tmp_path):
    partial = tmp_path / "partial"
    partial.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (partial / name).write_bytes((tiny_model_dir / name).read_bytes())
    deployment.model_version.path = str(partial)
    deployment.model_version.save()
    assert _start(deployment) == "failed"
    assert deployment.failure_code == "model_files"
    assert "no weight files" in deployment.state_reason
    assert deployment.pid is None


def test_it_refuses_a_changed_tokenizer_naming_the_file_before_launch(deployment, tiny_model_dir, tmp_path):
    copy = tmp_path / "copy"
    copy.mkdir()
    for path in tiny_model_dir.iterdir():
        (copy / path.name).write_bytes(path.read_bytes())
    (copy / "tokenizer_config.json").write_text("{}")
    deployment.model_version.path = str(copy)
    deployment.model_version.save()
    assert _start(deployment) == "failed"
    assert deployment.failure_code == "hash_mismatch"
    assert "tokenizer file changed: tokenizer_config.json" in deployment.state_reason
    assert "launch" not in [step for step, _ in _steps(deployment)]


def test_it_refuses_a_model_version_without_release_hashes(deployment):
    deployment.model_version.weights_sha256 = ""
    deployment.model_version.save()
    assert _start(deployment) == "failed"
    assert deployment.failure_code == "no_hashes"
    assert "hash_model" in deployment.state_reason


def test_it_classifies_a_known_startup_error_and_does_not_restart_it(deployment, monkeypatch):
    monkeypatch.setenv(
        "FAKE_VLLM_FAIL",
        "ValueError: To serve at least one request with the model's max seq len (512), (0.02 GiB KV "
        "cache is needed, which is larger than the available KV cache memory (0.01 GiB). Try "
        "increasing `gpu_memory_utilization` or decreasing `max_model_len` when initializing the engine.",
    )
    assert _start(deployment) == "failed"
    assert deployment.failure_code == "kv_cache_too_small"
    assert deployment.state_reason.startswith("the KV cache cannot hold one sequence")
    assert "KV cache is needed" in deployment.log_tail
    # Supervision leaves a classified failure alone: no restart loop.
    assert deployment_supervise(deployment.pk, owner="beat") == "failed: not restarted"


def test_it_reports_an_unknown_exit_with_the_last_error_line(deployment, monkeypatch):
    monkeypatch.setenv("FAKE_VLLM_FAIL", "RuntimeError: something nobody has seen before")
    _start(deployment)
    assert deployment.failure_code == "exited"
    assert "exited (code 1)" in deployment.state_reason
    assert "RuntimeError: something nobody has seen before" in deployment.state_reason


def test_it_refuses_gpus_whose_kernels_the_nodes_torch_lacks(team, llama7b, profile_tp1, dgx, reap_servers):
    dgx.vllm_python = sys.executable
    dgx.software_python = sys.executable
    dgx.software_probed_at = timezone.now()
    dgx.torch_version, dgx.torch_cuda_version = "2.11.0+cu128", "12.8"
    dgx.torch_arch_list = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]
    dgx.save()
    deployment = make_deployment(team, llama7b, profile_tp1, dgx, gpus=[0])
    assert _start(deployment) == "failed"
    assert deployment.failure_code == "no_kernel_image"
    assert "has no sm_70 kernels" in deployment.state_reason
    assert "cu126" in deployment.state_reason


def test_it_refuses_a_v100_when_vllms_own_kernels_lack_sm_70_though_torch_has_it(
    team, llama7b, profile_tp1, dgx, reap_servers, tmp_path
):
    python = fake_vllm_install(tmp_path, vllm_version="0.26.0", kernel_archs=["sm_75", "sm_80", "sm_90"])
    dgx.vllm_python = str(python)
    dgx.save()
    deployment = make_deployment(team, llama7b, profile_tp1, dgx, gpus=[0])
    assert _start(deployment) == "failed"
    assert deployment.failure_code == "no_kernel_image"
    assert "vLLM 0.26.0's _C.abi3.so has no sm_70 kernels" in deployment.state_reason
    assert "torch" not in deployment.state_reason.split(" for ")[0]  # torch itself has sm_70
    assert "vLLM 0.19.1 with torch 2.10" in deployment.state_reason
    assert "pip install vllm==0.19.1" in deployment.state_reason


def test_it_restarts_a_killed_engine_with_backoff(deployment, django_capture_on_commit_callbacks):
    _start(deployment)
    old_pgid = deployment.pgid
    os.kill(deployment.pid, signal.SIGKILL)
    _wait_dead(deployment.pid)
    with django_capture_on_commit_callbacks() as sent:
        assert deployment_supervise(deployment.pk, owner="beat") == "restart scheduled"
    deployment.refresh_from_db()
    assert deployment.state == "pending"
    assert deployment.restart_count == 1
    assert "is gone; restart 1 of 5" in deployment.state_reason
    assert len(sent) == 1  # the start task, queued with the backoff as countdown
    assert supervisor.group_members(old_pgid) == []  # the engine child did not survive its server
    assert _start(deployment) == "serving"
    assert deployment.pgid != old_pgid


def test_it_restarts_an_engine_whose_health_check_keeps_failing(
    deployment, run_dir, settings, django_capture_on_commit_callbacks
):
    settings.DEPLOYMENT_HEALTH_FAILURES = 2
    _start(deployment)
    (run_dir / deployment.name / "hang").touch()
    assert deployment_supervise(deployment.pk, owner="beat") == "unhealthy"
    with django_capture_on_commit_callbacks():
        assert deployment_supervise(deployment.pk, owner="beat") == "restart scheduled"
    deployment.refresh_from_db()
    assert "(hung)" in deployment.state_reason
    assert not supervisor.group_alive(deployment.pgid)


def test_it_gives_up_after_the_restart_limit(deployment, settings, django_capture_on_commit_callbacks):
    settings.DEPLOYMENT_RESTART_LIMIT = 1
    _start(deployment)
    Deployment.objects.filter(pk=deployment.pk).update(restart_count=1)
    os.kill(deployment.pid, signal.SIGKILL)
    _wait_dead(deployment.pid)
    with django_capture_on_commit_callbacks() as sent:
        assert deployment_supervise(deployment.pk, owner="beat") == "failed"
    deployment.refresh_from_db()
    assert deployment.state == "failed" and deployment.failure_code == "restart_limit"
    assert sent == []


def test_it_samples_health_metrics_and_memory_while_serving(deployment):
    _start(deployment)
    assert deployment_supervise(deployment.pk, owner="beat") == "healthy"
    sample = deployment.samples.get()
    assert sample.healthy and sample.kv_cache_usage == 0.25 and sample.running == 0
    assert sample.memory_mb > 1
    deployment.refresh_from_db()
    assert deployment.baseline_memory_mb == sample.memory_mb


def test_it_plans_a_restart_when_the_policy_says_so(deployment, django_capture_on_commit_callbacks):
    _start(deployment)
    Deployment.objects.filter(pk=deployment.pk).update(
        restart_after_hours=1, serving_since=timezone.now() - timezone.timedelta(hours=2)
    )
    with django_capture_on_commit_callbacks() as sent:
        assert deployment_supervise(deployment.pk, owner="beat") == "planned restart"
    assert len(sent) == 1
    assert "policy: restart after 1 h" in deployment.events.get(step="planned restart").message


def test_it_restarts_draining_first_and_serves_again(deployment):
    _start(deployment)
    old = deployment.pgid
    assert deployment_restart(deployment.pk, owner="agent", reason="test") == "serving"
    deployment.refresh_from_db()
    assert deployment.state == "serving" and deployment.pgid != old
    assert not supervisor.group_alive(old)
    assert "drain" in [step for step, _ in _steps(deployment)]


def test_it_recovers_a_start_whose_agent_died(deployment, django_capture_on_commit_callbacks):
    # What a killed worker leaves: state starting, a live server, an expired lease.
    _start(deployment)
    orphan = deployment.pgid
    Deployment.objects.filter(pk=deployment.pk).update(state="starting", lease_expires_at=timezone.now())
    with django_capture_on_commit_callbacks():
        assert deployment_supervise(deployment.pk, owner="beat") == "restart scheduled"
    assert not supervisor.group_alive(orphan)
    deployment.refresh_from_db()
    assert "interrupted while starting" in deployment.state_reason
    assert _start(deployment) == "serving"


@pytest.mark.django_db(transaction=True)
@pytest.mark.postgres(reason="concurrent connections")
def test_it_stops_a_start_when_the_deployment_is_stopped_meanwhile(deployment, monkeypatch):
    monkeypatch.setenv("FAKE_VLLM_STARTUP_S", "15")

    def stop_it():
        Deployment.objects.filter(pk=deployment.pk).update(desired_state="stopped")
        connection.close()

    threading.Timer(1.0, stop_it).start()
    assert _start(deployment) == "abandoned"
    assert deployment.state == "stopped"
    assert not supervisor.group_alive(deployment.pgid)


def test_it_launches_the_simulator_with_the_same_flags_and_the_hardware(
    team, tiny_profile, dgx, reap_servers, run_dir
):
    """Engine "sim": the portal's own Python runs inference.sim with vLLM's argv plus --hardware."""
    version = model_version_create(name="llama-2-7b-chat-hf", config=bundled_config("llama-2-7b-chat-hf"))
    profile = builders.profile(
        name="sim-7b", engine="sim", max_model_len=4096, gpu_memory_utilization=0.93, enforce_eager=True
    )
    team.gpu_quota = 8
    team.save()
    deployment = make_deployment(team, version, profile, dgx, gpus=[2])
    assert _start(deployment) == "serving", deployment.state_reason
    # The simulator guards /v1 with the deployment's key as vLLM does (VLLM_API_KEY).
    assert supervisor.served_models(deployment.endpoint_url) is None
    key = deployment.engine_api_key
    assert supervisor.served_models(deployment.endpoint_url, api_key=key) == ["llama-2-7b-chat-hf"]
    assert key not in deployment.command
    argv = deployment.command
    assert argv[:3] == [sys.executable, "-m", "inference.sim"]
    assert argv[-2:] == ["--hardware", "v100-sxm2-32gb"]
    model_dir = Path(argv[argv.index("--model") + 1])
    assert model_dir == run_dir / deployment.name
    assert json.loads((model_dir / "config.json").read_text()) == version.config
    messages = {e.step: e.message for e in deployment.events.all()}
    assert "no torch check" in messages["environment"]
    assert "simulator reads the stored config.json" in messages["hashes"]
    assert argv[argv.index("--max-model-len") + 1] == "4096"


@pytest.mark.django_db(transaction=True)
@pytest.mark.postgres(reason="concurrent connections")
def test_it_runs_exactly_one_server_when_the_start_runs_twice_at_once(
    team, tiny_version, tiny_profile, fake_node, reap_servers, monkeypatch
):
    monkeypatch.setenv("FAKE_VLLM_STARTUP_S", "1")
    deployment = make_deployment(team, tiny_version, tiny_profile, fake_node)
    results = []

    def run(owner):
        try:
            results.append(deployment_start(deployment.pk, owner=owner))
        finally:
            connection.close()

    threads = [threading.Thread(target=run, args=(f"agent-{i}",)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(results) == ["busy", "serving"]
    deployment.refresh_from_db()
    launches = deployment.events.filter(step="launch", status="ok").count()
    assert launches == 1
    servers = [
        pid
        for pid in map(int, filter(str.isdigit, os.listdir("/proc")))
        if "vllm.entrypoints.openai.api_server" in _cmdline(pid) and str(deployment.port) in _cmdline(pid)
    ]
    assert servers == [deployment.pid]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def test_the_engine_listens_on_the_nodes_address_and_is_checked_there(deployment):
    from portal.inventory.models import Node

    Node.objects.filter(pk=deployment.node_id).update(hostname="127.0.0.2")  # not the agent's loopback
    assert _start(deployment) == "serving"
    assert deployment.command[deployment.command.index("--host") + 1] == "127.0.0.2"
    assert deployment.endpoint_url == f"http://127.0.0.2:{deployment.port}"
    assert "the gateway reaches the server at 127.0.0.2" in deployment.events.get(step="address").message
    assert supervisor.check_health(deployment.endpoint_url)


def test_a_node_whose_name_does_not_resolve_is_never_shown_serving_and_says_why(deployment):
    from portal.inventory.models import Node

    Node.objects.filter(pk=deployment.node_id).update(hostname="node-that-does-not-resolve.invalid")
    _start(deployment)
    assert deployment.state == "failed"
    assert deployment.failure_code == "unreachable"
    assert "does not resolve" in deployment.state_reason
    assert "fix the node's hostname" in deployment.state_reason
    assert deployment.pid is None


def test_supervision_checks_the_gateways_address_and_says_when_its_name_stops_resolving(deployment):
    from portal.inventory.models import Node

    assert _start(deployment) == "serving"
    Node.objects.filter(pk=deployment.node_id).update(hostname="renamed-node.invalid")
    assert deployment_supervise(deployment.pk, owner="beat") == "unhealthy"
    failed = deployment.events.filter(step="health", status="failed").last()
    assert "/health did not answer at http://renamed-node.invalid:" in failed.message
    assert "does not resolve" in failed.message


# Committed rows: the stalled agent runs on its own thread and database connection.
@pytest.mark.django_db(transaction=True)
def test_an_agent_stalled_past_its_lease_mid_start_is_fenced_out_and_stops_what_it_launched(
    team, tiny_version, tiny_profile, fake_node, run_dir, reap_servers, settings
):
    from tests.helpers.jobs import StalledWorker
    from tests.helpers.processes import engine_groups

    settings.DEPLOYMENT_LEASE_TTL_S = 1
    deployment = make_deployment(team, tiny_version, tiny_profile, fake_node)
    # The first agent launches its server, then stalls before it records the pid.
    first = StalledWorker(
        "agent-a",
        lambda worker: deployment_start(deployment.pk, owner=worker),
        pause_when=lambda fields: "pid" in fields,
    )
    try:
        stalled = first.start_and_wait_stalled()
        # A second start message, after the lease lapsed: the second agent takes over.
        assert _start(deployment, owner="agent-b") == "serving"
        first.resume()
    finally:
        first.close()

    assert first.error is None and first.result == "lease lost"
    deployment.refresh_from_db()
    assert deployment.state == "serving" and deployment.lease_token == stalled.token + 1
    assert supervisor.check_health(deployment.endpoint_url)
    # Exactly one engine: the first agent's write of its pid was refused, and it stopped its server.
    wait_until(
        lambda: list(engine_groups(run_dir)) == [deployment.pgid],
        what="only the second agent's engine left",
        timeout_s=30,
    )
    assert deployment.events.filter(step="launch", status="ok").count() == 1
    assert deployment.events.filter(step="serving").count() == 1
