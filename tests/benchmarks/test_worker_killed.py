"""A benchmark run whose Celery worker is SIGKILLed mid-run ends (failed, with the levels it saved
kept), never `running` for good.

A real worker on the benchmarks queue (prefork, one pool process, as the Procfile runs it) runs a
staff run against the fake server with a short lease (BENCHMARK_LEASE_S=2). The whole worker is
killed, as by the OOM killer: the message stays unacknowledged in Redis until the visibility
timeout, and no job is left to finish the run. The beat sweep (`benchmarks.expire_runs`, called
here at a test's pace) then ends it once the dead worker's lease lapses.
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
from django.db import connection

from portal.benchmarks.models import BenchmarkRun, RunState
from portal.benchmarks.services import BenchmarkRunRequest, benchmark_run_create, benchmark_runs_expire
from portal.celery import BENCHMARK_QUEUE
from portal.core.redis.client import redis_keys
from tests.helpers import ROOT
from tests.helpers.builders import make_serving_deployment
from tests.helpers.processes import stop
from tests.helpers.waiting import wait_until

pytestmark = [pytest.mark.django_db(transaction=True)]

LEASE_S = 2


def start_worker(log_path) -> subprocess.Popen:
    database = connection.settings_dict
    env = dict(
        os.environ,
        DJANGO_SETTINGS_MODULE="tests.settings",
        DATABASE_URL=f"postgres://{database['USER']}@{database['HOST']}:{database['PORT']}/{database['NAME']}",
        CELERY_BROKER_URL=settings.CELERY_BROKER_URL,
        CELERY_RESULT_BACKEND=settings.CELERY_RESULT_BACKEND,
        BENCHMARK_LEASE_S=str(LEASE_S),
    )
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "portal", "worker", "-Q", BENCHMARK_QUEUE,
             "--concurrency", "1", "--without-heartbeat", "--without-mingle", "--without-gossip",
             "--loglevel", "INFO", "-n", f"bench-killed-{os.getpid()}-{time.time()}@%h"],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip


@pytest.mark.timeout(180)
def test_a_run_whose_worker_is_killed_mid_run_ends_failed_not_running(
    alice, team, llama7b, profile_tp8, dgx, fake_server_factory, tmp_path
):
    broker = redis.Redis.from_url(settings.CELERY_BROKER_URL)
    broker.delete(redis_keys().celery_key(BENCHMARK_QUEUE))  # what an earlier test left queued
    server = fake_server_factory(first_token_s=0.01, token_interval_s=0.05)
    deployment = make_serving_deployment(
        team=team, model=llama7b, profile=profile_tp8, node=dgx, url=server.url
    )
    log_path = tmp_path / "worker.log"
    worker = start_worker(log_path)
    try:
        run = benchmark_run_create(
            user=alice,
            run_request=BenchmarkRunRequest(
                deployment=deployment, mix="fixed:16:8", concurrencies=[1, 1], requests_per_level=1000
            ),
        )
        wait_until(
            lambda: server.server.received >= 3,
            timeout_s=90,
            what=f"the run measuring\n{log_path.read_text()}",
        )
        assert BenchmarkRun.objects.get(pk=run.pk).state == RunState.RUNNING
        os.killpg(worker.pid, signal.SIGKILL)  # the worker and its pool process, mid-level
        worker.wait(timeout=10)

        ended = wait_until(
            lambda: benchmark_runs_expire(), timeout_s=LEASE_S * 10, what="the lapsed run ended"
        )
        run.refresh_from_db()
        assert ended == [run.pk]
        assert run.state == RunState.FAILED, run.state_reason
        assert "lease" in run.state_reason and run.finished_at is not None
    finally:
        if worker.poll() is None:
            stop(worker)
        keys = [redis_keys().celery_key(name) for name in (BENCHMARK_QUEUE, "unacked", "unacked_index")]
        broker.delete(*keys)
        broker.close()
