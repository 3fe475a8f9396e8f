"""A benchmark run whose Celery worker is SIGKILLed mid-run ends failed (the levels it saved kept)
or resumed, never `running` for good.

A real worker on the benchmarks queue (prefork, one pool process, as the Procfile runs it) runs a
staff run against the fake server with a short lease (BENCHMARK_LEASE_S=2). Two ways it dies:

- `worker`: the whole worker, as by the OOM killer: the message stays unacknowledged in Redis
  until the visibility timeout, and no job is left to finish the run;
- `child`: only the pool process: the main process rejects the message (reject on worker lost),
  its new pool process gets it again at once and, finding the dead process's lease live, drops
  it (or resumes the run, when the lease lapsed first).

The beat sweep (`benchmarks.expire_runs`, called here at a test's pace) ends a run nobody holds
once the dead process's lease lapses: failed, never `running` for good.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import redis
from django.conf import settings

from devtools import children_of, stop, wait_until
from portal.benchmarks.models import BenchmarkRun, RunState
from portal.benchmarks.services import BenchmarkRunRequest, benchmark_run_create, benchmark_runs_expire
from portal.celery import BENCHMARK_QUEUE
from portal.core.redis.client import redis_keys
from tests.helpers import ROOT
from tests.helpers.builders import make_serving_deployment
from tests.helpers.processes import worker_env

pytestmark = [pytest.mark.django_db(transaction=True)]

LEASE_S = 2


def start_worker(log_path) -> subprocess.Popen:
    env = worker_env(BENCHMARK_LEASE_S=str(LEASE_S))
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "portal", "worker", "-Q", BENCHMARK_QUEUE,
             "--concurrency", "1", "--without-heartbeat", "--without-mingle", "--without-gossip",
             "--loglevel", "INFO", "-n", f"bench-killed-{os.getpid()}-{time.time()}@%h"],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip


def pool_process(pid: int) -> int:
    """The worker's one pool process (a child of its main process)."""
    (child,) = children_of(pid)
    return child


@pytest.mark.timeout(240)
@pytest.mark.parametrize("killed", ["worker", "child"])
def test_a_run_whose_worker_is_killed_mid_run_ends_failed_or_resumed_never_stuck(
    alice, team, llama7b, profile_tp8, dgx, fake_server_factory, tmp_path, killed
):
    broker = redis.Redis.from_url(settings.CELERY_BROKER_URL)
    broker.delete(redis_keys().celery_key(BENCHMARK_QUEUE))  # what an earlier test left queued
    server = fake_server_factory(first_token_s=0.01, token_interval_s=0.05)  # ~0.4 s a request
    deployment = make_serving_deployment(
        team=team, model=llama7b, profile=profile_tp8, node=dgx, url=server.url
    )
    log_path = tmp_path / "worker.log"
    worker = start_worker(log_path)
    try:
        run = benchmark_run_create(
            user=alice,
            run_request=BenchmarkRunRequest(
                deployment=deployment, mix="fixed:16:8", concurrencies=[1, 1], requests_per_level=20
            ),
        )
        wait_until(
            lambda: server.server.received >= 3,
            timeout_s=90,
            what=f"the run measuring\n{log_path.read_text()}",
        )
        assert BenchmarkRun.objects.get(pk=run.pk).state == RunState.RUNNING
        if killed == "worker":
            os.killpg(worker.pid, signal.SIGKILL)  # the worker and its pool process, mid-level
            worker.wait(timeout=10)
        else:
            os.kill(pool_process(worker.pid), signal.SIGKILL)

        def ended() -> bool:
            benchmark_runs_expire()  # what beat does every BENCHMARK_SWEEP_INTERVAL_S
            run.refresh_from_db()
            return run.finished

        wait_until(
            ended, timeout_s=150, interval_s=0.5, what=f"the run ended\n{log_path.read_text()[-3000:]}"
        )
        print(f"\n[{killed}] {run.state}: {run.state_reason}")
        if killed == "worker":  # no process is left to resume it
            assert run.state == RunState.FAILED and "lease" in run.state_reason
        else:
            # The redelivered message reaches the new pool process at once: it drops itself while
            # the dead process's lease is live (then the sweep fails the run), or resumes the run
            # from its first unsaved level when the lease lapsed first (a slow pool start).
            resumed = run.state == RunState.DONE and run.levels.count() == 2
            assert resumed or (run.state == RunState.FAILED and "lease" in run.state_reason), run.state_reason
    finally:
        if worker.poll() is None:
            stop(worker)
        keys = [redis_keys().celery_key(name) for name in (BENCHMARK_QUEUE, "unacked", "unacked_index")]
        broker.delete(*keys)
        broker.close()
