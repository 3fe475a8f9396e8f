"""Fixtures for the rollout tests: a pair of versions, the control worker and beat, a gateway process
and simulated versions (builders in tests/helpers/rollouts.py)."""

from __future__ import annotations

import pytest

from tests.helpers.rollouts import CONTROL_ENV, Control, Pair, make_pair


@pytest.fixture
def pair(db, team, cpu_node) -> Pair:
    return make_pair(team=team, node=cpu_node)


@pytest.fixture
def control(transactional_db, tmp_path):
    """The control worker and beat against the test database, with CONTROL_ENV."""
    import subprocess
    import sys
    import time

    import redis
    from django.db import connection

    from devtools import stop
    from portal.core.redis.client import redis_keys
    from tests.helpers.gateway import REDIS_URL
    from tests.helpers.stack import stack_env

    env = {
        **stack_env(database=connection.settings_dict, redis_url=REDIS_URL, run_dir=tmp_path),
        **CONTROL_ENV,
    }
    broker = redis.Redis.from_url(REDIS_URL)
    broker.delete(redis_keys().celery_key("control"))  # what an earlier test left on the queue
    broker.close()
    handle = Control(env=env, directory=tmp_path)
    handle.start_worker()
    beat_log = tmp_path / "beat.log"
    with open(beat_log, "wb") as log:
        handle.beat = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "portal", "beat",
             "--schedule", str(tmp_path / "beat-schedule"), "--loglevel", "INFO"],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    deadline = time.monotonic() + 60
    while "beat: Starting" not in beat_log.read_text(errors="replace"):
        assert handle.beat.poll() is None and time.monotonic() < deadline, handle.logs()
        time.sleep(0.2)
    yield handle
    for process in (handle.beat, handle.worker):
        if process is not None and process.poll() is None:
            stop(process)


@pytest.fixture
def rollout_gateway(transactional_db, tmp_path):
    """A gateway process that reloads routes (and so shares) every second, with first-token and
    read timeouts no loaded CPU reaches; the gateway's Redis state emptied first."""
    from devtools import stop
    from tests.helpers.gateway import REDIS_URL, start_gateway
    from tests.helpers.stack import clear_gateway_state

    clear_gateway_state(REDIS_URL)

    gateway, process = start_gateway(
        tmp_path / "gateway.log",
        GATEWAY_CACHE_S="1",
        GATEWAY_FIRST_TOKEN_TIMEOUT_S="60",
        GATEWAY_READ_TIMEOUT_S="60",
    )
    yield gateway
    stop(process)


@pytest.fixture
def sims(tmp_path):
    """Start simulated versions: `sims(name, speedup=1.0) -> url`; all stopped after the test."""
    from devtools import stop
    from perf.rollout_load import spawn_sim

    processes = []

    def start(name: str, *, speedup: float = 1.0) -> str:
        url, process = spawn_sim(name, tmp_path / f"sim-{name}.log", speedup=speedup)
        processes.append(process)
        return url

    yield start
    for process in processes:
        stop(process)
