"""A GPU turns degraded under a serving deployment: the real node agent reads it from a fake
`nvidia-smi` on its PATH, the deployment is drained (the gateway stops routing to it), stopped and
started on a healthy GPU through the normal lifecycle, and no request through the gateway fails.

The model has a second replica on a healthy GPU, as a production model does: while the moved one is
drained, stopped and started again the gateway sends its traffic there (docs/decisions.md, "Deployments
on a degraded or lost GPU", says why a lone replica cannot move without a gap).
"""

from __future__ import annotations

import threading
import time
import uuid

import httpx
import pytest
from django.db import close_old_connections
from django.utils import timezone

from devtools import wait_until
from portal.audit.models import AuditEvent
from portal.deployments.models import Deployment
from portal.inventory.dispatch import send_to_node
from portal.inventory.models import Gpu
from portal.registry.services import model_version_create
from portal.teams.services import api_key_create
from tests.helpers import builders
from tests.helpers.agents import FakeNvidiaSmi, node_agent
from tests.helpers.gateway import chat_body
from tests.helpers.samples import bundled_config

# A real agent, gateway and simulator moving a deployment under traffic: 15-50 s, out of make test-fast.
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


class Traffic(threading.Thread):
    """Requests one after another through the gateway until stopped; every status kept."""

    def __init__(self, url: str, token: str, model: str) -> None:
        super().__init__(daemon=True)
        self.url, self.token, self.model = url, token, model
        self.statuses: list[int] = []
        self.failures: list[str] = []
        self.failed_at: list[float] = []
        self.halt = threading.Event()

    def run(self) -> None:
        with httpx.Client(timeout=60) as client:
            while not self.halt.is_set():
                response = client.post(
                    f"{self.url}/v1/chat/completions",
                    json=chat_body(self.model, max_tokens=4),
                    headers={"Authorization": f"Bearer {self.token}"},
                )
                self.statuses.append(response.status_code)
                if response.status_code != 200:
                    self.failures.append(response.text[:300])
                    self.failed_at.append(time.monotonic())


@pytest.mark.parametrize("replicas", [2, 1])
def test_a_deployment_on_a_gpu_turning_degraded_moves_under_traffic(
    gateway, gw_redis, team, dgx, tmp_path, settings, replicas
):
    """Two replicas: no request fails. One: the move has a gap, measured (printed), each failure a clean
    OpenAI error (the gateway's route cache, GATEWAY_CACHE_S, is 30 s in these tests)."""
    settings.PORTAL_RUN_DIR = str(tmp_path / "run")
    smi = FakeNvidiaSmi(tmp_path / "bin")
    smi.show("health_v100_sxm2_8x_healthy.csv")
    # A model name of its own: the gateway process caches each model's routes across tests.
    name = f"sim-{uuid.uuid4().hex[:8]}"
    version = model_version_create(name=name, config=bundled_config("llama-2-7b-chat-hf"))
    profile = builders.profile(
        name="sim-7b", engine="sim", max_model_len=4096, gpu_memory_utilization=0.93, enforce_eager=True
    )
    from portal.deployments.services import deployment_create

    env = {"PATH": smi.path, "PORTAL_RUN_DIR": settings.PORTAL_RUN_DIR, "DEPLOYMENT_DRAIN_TIMEOUT_S": "10"}
    # The agent also takes `control`: the drain its sample sends there runs without another worker.
    with node_agent(dgx.name, tmp_path / "agent.log", also_queues=("control",), **env):
        send_to_node(dgx, "inventory.sample_gpu_health", args=[dgx.name])
        healthy = dgx.gpus.filter(health_state="healthy")
        wait_until(lambda: healthy.count() == 8, timeout_s=120, what="sampled")
        moved, *others = (
            deployment_create(
                name=name, team=team, model_version=version, profile=profile, node=dgx, gpu_indices=[index]
            )
            for name, index in (("chat-a", 3), ("chat-b", 5))[:replicas]
        )
        serving = Deployment.objects.filter(state="serving")
        wait_until(lambda: serving.count() == replicas, timeout_s=180, what="every replica serving")
        _, token = api_key_create(team=team, name="move", allowed_models=[version.name])
        traffic = Traffic(gateway.url, token, version.name)
        traffic.start()
        wait_until(lambda: traffic.statuses.count(200) >= 5, timeout_s=60, what="traffic flowing")

        smi.show("health_v100_sxm2_8x_ecc_uncorrectable.csv")
        send_to_node(dgx, "inventory.sample_gpu_health", args=[dgx.name])
        sick = Gpu.objects.filter(node=dgx, index=3, health_state="degraded")
        wait_until(sick.exists, timeout_s=120, what="GPU 3 degraded")
        degraded_at = sick.get().health_since

        back = Deployment.objects.filter(pk=moved.pk, state="serving", gpu_indices=[0])
        wait_until(back.exists, timeout_s=180, what="the moved deployment serving on GPU 0")
        serving_again_at = back.get().serving_since
        sent_before = len(traffic.statuses)
        answered = lambda: traffic.statuses[sent_before:].count(200) >= 5  # noqa: E731
        wait_until(answered, timeout_s=90, what="answers after the move")
        traffic.halt.set()
        traffic.join(timeout=60)
        close_old_connections()

    seconds = (serving_again_at - degraded_at).total_seconds()
    print(
        f"\n{replicas} replica(s): GPU degraded → serving elsewhere {seconds:.1f} s; {len(traffic.statuses)} "
        f"requests through the gateway, {len(traffic.failures)} failed ({sorted(set(traffic.statuses))})"
        + (f" over {traffic.failed_at[-1] - traffic.failed_at[0]:.1f} s" if traffic.failed_at else "")
    )
    if replicas == 2:
        assert traffic.failures == []
        assert others[0].pk in Deployment.objects.filter(state="serving").values_list("pk", flat=True)
    else:
        assert set(traffic.statuses) <= {200, 502, 503}
        assert all('"error"' in failure for failure in traffic.failures)
    events = list(Deployment.objects.get(pk=moved.pk).events.all())
    steps = [(e.step, e.status) for e in events]
    assert ("drain", "ok") in steps and ("gpu-health", "ok") in steps
    decision = next(e for e in events if (e.step, e.status) == ("gpu-health", "info"))
    assert decision.message.startswith("moving from dgx-v100-01:3 to dgx-v100-01:0")
    assert AuditEvent.objects.filter(action="deployment.gpu_move", target_id=str(moved.pk)).exists()
    assert timezone.now() > serving_again_at > degraded_at
