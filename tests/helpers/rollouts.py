"""Builders for rollout tests: a served model `chat` at 100 % on an old version's serving deployment and a
new version's deployment beside it; latency rows; the control worker and beat as killable processes."""

from __future__ import annotations

import datetime as dt
import uuid
from dataclasses import dataclass


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
    from tests.helpers.samples import bundled_config

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


def on_eight_gpus(deployment):
    """Move `deployment` onto a profile of 8 GPUs in tensor parallel (other hardware than a 1-GPU one)."""
    from portal.deployments.models import Deployment, DeploymentProfile

    profile = DeploymentProfile.objects.create(
        name=f"tp8-{deployment.name}", model_version=deployment.model_version,
        target_gpu_count=8, tensor_parallel_size=8,
    )  # fmt: skip
    Deployment.objects.filter(pk=deployment.pk).update(profile=profile)
    deployment.refresh_from_db()
    return deployment
