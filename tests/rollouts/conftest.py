"""A served model `chat` at 100 % on an old version's serving deployment, and a new version's
deployment beside it (tests/rollouts)."""

from __future__ import annotations

import datetime as dt
import uuid
from dataclasses import dataclass

import pytest


@dataclass
class Pair:
    served: object
    old: object  # the old version's deployment
    new: object  # the new version's deployment


def released(version):
    """Give a version release hashes, as `hash_model` would have recorded (a rollout needs them)."""
    from portal.registry.models import ModelVersion

    ModelVersion.objects.filter(pk=version.pk).update(weights_sha256="a" * 64, tokenizer_sha256="b" * 64)
    version.refresh_from_db()
    return version


def deployment_of(
    *, team, node, name: str, state: str = "serving", config: str = "llama-2-7b-chat-hf",
    gpu_indices: list[int] | None = None, desired_state: str = "running", profile=None,
):  # fmt: skip
    from portal.deployments.models import Deployment, DeploymentProfile
    from portal.registry.services import model_version_create
    from tests.conftest import bundled_config

    version = released(model_version_create(name=name, config=bundled_config(config)))
    profile = profile or DeploymentProfile.objects.create(name=f"p-{name}", model_version=version)
    return Deployment.objects.create(
        name=f"d-{name}",
        team=team,
        model_version=version,
        profile=profile,
        node=node,
        gpu_indices=gpu_indices or [],
        desired_state=desired_state,
        state=state,
        endpoint_url="http://127.0.0.1:9" if state == "serving" else "",
    )


def make_pair(*, team, node, new_state: str = "serving") -> Pair:
    from portal.registry.services import served_model_create

    tag = uuid.uuid4().hex[:6]
    old = deployment_of(team=team, node=node, name=f"chat-v1-{tag}")
    new = deployment_of(team=team, node=node, name=f"chat-v2-{tag}", state=new_state)
    served = served_model_create(name=f"chat-{tag}", shares={old.model_version.name: 10_000})
    return Pair(served, old, new)


@pytest.fixture
def pair(db, team, cpu_node) -> Pair:
    return make_pair(team=team, node=cpu_node)


def measured(deployment, minute: dt.datetime, *, requests: int = 50, errors: int = 0,
             ttft_ms: float = 400.0, tpot_ms: float = 40.0):  # fmt: skip
    """A gateway latency rollup row, as `latency_rollup` would have written it."""
    from portal.observability.models import LatencyMinute

    return LatencyMinute.objects.update_or_create(
        deployment=deployment,
        minute=minute.replace(second=0, microsecond=0),
        defaults=dict(requests=requests, errors=errors, p95_ttft_ms=ttft_ms, p95_tpot_ms=tpot_ms),
    )[0]


def shares_of(served) -> dict[str, int]:
    return dict(served.versions.values_list("model_version__name", "share_bp"))


# --- End to end: the gateway, versions on real servers, the control worker and beat ---------------

# The rollout's own pace in these tests, and the processes' settings it needs: beat ticks every
# second, every gateway process reloads shares within a second, and the latency ratio to the old
# version is left out (a tiny vLLM-CPU model and a simulated V100 7B are not comparable).
CONTROL_ENV = {"ROLLOUT_TICK_S": "1", "GATEWAY_CACHE_S": "1", "ROLLOUT_MAX_LATENCY_RATIO": "100"}


def serving_on(*, team, node, name: str, url: str, sla_ttft_s: float = 30, sla_tpot_s: float = 5):
    """A serving deployment of a new version `name` (with release hashes) at `url`: the server
    must serve the model under that name (vLLM's --served-model-name)."""
    from portal.deployments.models import Deployment

    deployment = deployment_of(team=team, node=node, name=name)
    Deployment.objects.filter(pk=deployment.pk).update(
        endpoint_url=url, sla_p95_ttft_s=sla_ttft_s, sla_p95_tpot_s=sla_tpot_s
    )
    deployment.refresh_from_db()
    return deployment


@dataclass
class Control:
    """The control worker (a real Celery worker on the `control` queue) and beat, killable."""

    env: dict
    directory: object
    worker: object = None
    beat: object = None
    starts: int = 0

    def start_worker(self) -> None:
        import subprocess
        import sys
        import time

        self.starts += 1
        log_path = self.directory / f"control-{self.starts}.log"
        argv = [sys.executable, "-m", "celery", "-A", "portal", "worker", "-Q", "control", "-n",
                f"control-r{self.starts}-{uuid.uuid4().hex[:6]}@%h", "--pool", "solo", "--without-mingle",
                "--without-gossip", "--loglevel", "INFO"]  # fmt: skip
        with open(log_path, "wb") as log:
            self.worker = subprocess.Popen(
                argv, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + 90
        while " ready." not in log_path.read_text(errors="replace"):
            assert self.worker.poll() is None, log_path.read_text(errors="replace")[-3000:]
            assert time.monotonic() < deadline, "the control worker did not start"
            time.sleep(0.2)

    def kill_worker(self) -> None:
        """SIGKILL, as a crash or an OOM kill: no shutdown, no task finished cleanly."""
        import os
        import signal

        os.killpg(self.worker.pid, signal.SIGKILL)
        self.worker.wait(timeout=10)

    def logs(self) -> str:
        return "\n".join(
            f"== {p.name} ==\n" + p.read_text(errors="replace")[-3000:]
            for p in sorted(self.directory.glob("*.log"))
        )


@pytest.fixture
def control(transactional_db, tmp_path):
    """The control worker and beat against the test database, with CONTROL_ENV."""
    import subprocess
    import sys
    import time

    import redis
    from django.db import connection

    from portal.core.redis.client import redis_keys
    from tests.gateway.conftest import REDIS_URL, stop
    from tests.stack import stack_env

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
    from tests.gateway.conftest import REDIS_URL, start_gateway, stop
    from tests.stack import clear_gateway_state

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
    from perf._common import stop
    from perf.rollout_load import spawn_sim

    processes = []

    def start(name: str, *, speedup: float = 1.0) -> str:
        url, process = spawn_sim(name, tmp_path / f"sim-{name}.log", speedup=speedup)
        processes.append(process)
        return url

    yield start
    for process in processes:
        stop(process)
