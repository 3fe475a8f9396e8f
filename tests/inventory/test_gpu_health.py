"""GPU health on the portal side: samples kept per minute, states and findings, placement refusing a
sick GPU, ops marking it healthy, retention, and the real node agent sampling a fake nvidia-smi."""

from __future__ import annotations

import datetime as dt

import pytest
from django.utils import timezone

from inference.gpu_health import Sample, parse_health_csv, parse_kernel_log
from portal.audit.models import AuditEvent
from portal.core.errors import ApplicationError
from portal.dashboard.services import retention_prune
from portal.inventory.models import Gpu, GpuSample, Node
from portal.inventory.services import (
    gpu_mark_healthy,
    node_apply_nvidia_smi_text,
    node_create,
    node_record_gpu_health,
)
from tests.helpers.agents import FakeNvidiaSmi, node_agent
from tests.helpers.clients import api_client
from tests.helpers.samples import nvidia_smi_sample

pytestmark = pytest.mark.django_db


def _sample(fixture: str, *, at: dt.datetime | None = None, kernel_log: str = "") -> Sample:
    return Sample(
        at=at or timezone.now(),
        gpus=tuple(parse_health_csv(nvidia_smi_sample(fixture))),
        xids=tuple(parse_kernel_log(nvidia_smi_sample(kernel_log) if kernel_log else "")),
    )


def test_it_keeps_one_sample_per_gpu_per_minute_and_marks_every_gpu_healthy(dgx):
    at = timezone.now().replace(second=5, microsecond=0)
    node_record_gpu_health(node=dgx, sample=_sample("health_v100_sxm2_8x_healthy.csv", at=at))
    later = at.replace(second=40)
    node_record_gpu_health(node=dgx, sample=_sample("health_v100_sxm2_8x_healthy.csv", at=later))
    assert GpuSample.objects.filter(gpu__node=dgx).count() == 8
    sample = GpuSample.objects.get(gpu__node=dgx, gpu__index=0)
    assert sample.at == at.replace(second=40) and sample.minute == at.replace(second=0)
    assert (sample.utilization_pct, sample.temperature_c, sample.power_draw_w) == (87, 61, 211.45)
    assert sample.pcie_width == 16 and sample.state == "healthy"
    assert set(dgx.gpus.values_list("health_state", flat=True)) == {"healthy"}


def test_it_turns_a_gpu_with_uncorrectable_ecc_errors_degraded_and_audits_it(dgx):
    node_record_gpu_health(node=dgx, sample=_sample("health_v100_sxm2_8x_healthy.csv"))
    changes = node_record_gpu_health(node=dgx, sample=_sample("health_v100_sxm2_8x_ecc_uncorrectable.csv"))
    assert [(c.index, c.before, c.after) for c in changes] == [(3, "healthy", "degraded")]
    gpu = dgx.gpus.get(index=3)
    assert gpu.health_state == "degraded" and gpu.health_findings[0]["code"] == "ecc_uncorrectable"
    audit = AuditEvent.objects.get(action="gpu.health")
    assert audit.target_repr == "dgx-v100-01:3" and audit.changes == {"health_state": ["healthy", "degraded"]}


def test_it_calls_a_gpu_that_stopped_answering_lost_and_one_on_a_node_without_nvidia_smi_nothing(dgx):
    node_record_gpu_health(node=dgx, sample=_sample("health_v100_sxm2_8x_gpu4_missing.csv"))
    assert dgx.gpus.get(index=4).health_state == "lost"
    assert not GpuSample.objects.get(gpu__index=4).answered
    assert node_record_gpu_health(node=dgx, sample=Sample(at=timezone.now(), unavailable=True)) == []
    assert dgx.gpus.get(index=4).health_state == "lost"


def test_it_counts_throttling_across_samples_until_it_is_sustained(dgx, settings):
    settings.GPU_HEALTH_THROTTLE_MINUTES = 5
    start = timezone.now() - dt.timedelta(minutes=10)
    for minutes in (0, 3, 6):
        at = start + dt.timedelta(minutes=minutes)
        node_record_gpu_health(node=dgx, sample=_sample("health_v100_sxm2_8x_throttling.csv", at=at))
        codes = [f["code"] for f in dgx.gpus.get(index=2).health_findings]
        assert codes == (["hot"] if minutes < 5 else ["thermal_throttling", "hot"]), minutes
    assert dgx.gpus.get(index=2).throttled_since == start
    node_record_gpu_health(node=dgx, sample=_sample("health_v100_sxm2_8x_healthy.csv"))
    gpu = dgx.gpus.get(index=2)
    assert gpu.throttled_since is None and gpu.health_state == "healthy"


def test_it_refuses_to_place_a_deployment_on_a_degraded_gpu_with_the_reason(dgx, team, llama7b, profile_tp1):
    from portal.deployments.services import deployment_create

    node_record_gpu_health(node=dgx, sample=_sample("health_v100_sxm2_8x_ecc_uncorrectable.csv"))
    with pytest.raises(ApplicationError) as refused:
        deployment_create(
            name="on-bad", team=team, model_version=llama7b, profile=profile_tp1, node=dgx, gpu_indices=[3]
        )
    assert refused.value.field == "gpu_indices"
    assert "GPU 3 is degraded" in refused.value.message and "uncorrectable ECC" in refused.value.message
    deployment_create(
        name="on-good", team=team, model_version=llama7b, profile=profile_tp1, node=dgx, gpu_indices=[2]
    )


def test_it_lets_staff_mark_a_gpu_healthy_after_a_reset_and_forgets_older_xids(dgx, alice, bob):
    log = "kernel_log_xid_dmesg_iso.txt"
    at = dt.datetime(2026, 12, 2, 3, 30, tzinfo=dt.UTC)
    node_record_gpu_health(node=dgx, sample=_sample("health_v100_sxm2_8x_healthy.csv", at=at, kernel_log=log))
    gpu = dgx.gpus.get(index=4)
    assert gpu.health_state == "lost" and gpu.health_findings[0]["code"] == "xid_79"
    assert api_client(bob).post(f"/api/v1/gpus/{gpu.pk}/mark-healthy/").status_code == 403
    response = api_client(alice).post(f"/api/v1/gpus/{gpu.pk}/mark-healthy/")
    assert response.status_code == 200 and response.json()["health_state"] == "healthy"
    assert AuditEvent.objects.get(action="gpu.mark_healthy").actor_repr == alice.username
    # Marked healthy before the Xid was logged (03:17:52): it still counts.
    Gpu.objects.filter(pk=gpu.pk).update(health_cleared_at=at - dt.timedelta(minutes=30))
    again = _sample("health_v100_sxm2_8x_healthy.csv", at=at + dt.timedelta(minutes=1), kernel_log=log)
    node_record_gpu_health(node=dgx, sample=again)
    assert dgx.gpus.get(index=4).health_state == "lost"
    # Marked healthy after it: the same kernel log read again (before a reboot clears it) is history.
    gpu_mark_healthy(gpu=gpu)
    node_record_gpu_health(node=dgx, sample=_sample("health_v100_sxm2_8x_healthy.csv", kernel_log=log))
    assert dgx.gpus.get(index=4).health_state == "healthy"


def test_it_prunes_gpu_samples_past_their_retention(dgx, settings):
    settings.RETENTION_GPU_SAMPLES_DAYS = 7
    old = timezone.now() - dt.timedelta(days=8)
    node_record_gpu_health(node=dgx, sample=_sample("health_v100_sxm2_8x_healthy.csv", at=old))
    node_record_gpu_health(node=dgx, sample=_sample("health_v100_sxm2_8x_healthy.csv"))
    assert retention_prune()["gpu_samples"] == 8
    assert GpuSample.objects.count() == 8


@pytest.mark.slow  # waits out a real timeout or a simulated acceptance
@pytest.mark.django_db(transaction=True)
def test_the_node_agent_samples_a_fake_nvidia_smi_and_takes_a_hung_one_as_lost(dgx, tmp_path):
    from django.db import close_old_connections

    from devtools import wait_until
    from portal.inventory.dispatch import send_to_node

    smi = FakeNvidiaSmi(tmp_path / "bin")
    smi.show("health_v100_sxm2_8x_ecc_uncorrectable.csv")
    with node_agent(dgx.name, tmp_path / "agent.log", PATH=smi.path, GPU_HEALTH_COMMAND_TIMEOUT_S="2"):
        send_to_node(dgx, "inventory.sample_gpu_health", args=[dgx.name])
        wait_until(lambda: GpuSample.objects.count() == 8, timeout_s=120, what="8 samples")
        assert dict(dgx.gpus.values_list("index", "health_state"))[3] == "degraded"
        assert GpuSample.objects.get(gpu__index=3).ecc_uncorrected_volatile == 2
        smi.hang()
        send_to_node(dgx, "inventory.sample_gpu_health", args=[dgx.name])
        states = lambda: set(dgx.gpus.values_list("health_state", flat=True))  # noqa: E731
        wait_until(lambda: states() == {"lost"}, timeout_s=120, what="all lost")
        close_old_connections()
    finding = dgx.gpus.get(index=0).health_findings[0]
    assert finding["code"] == "no_answer" and "did not answer within 2 s" in finding["message"]


def test_beat_asks_every_node_with_gpus_for_a_sample(dgx, cpu_node, django_capture_on_commit_callbacks):
    from portal.celery import app
    from portal.inventory.tasks import sample_gpu_health_all

    simulated = node_create(name="sim-dgx")
    node_apply_nvidia_smi_text(node=simulated, query_csv=nvidia_smi_sample("v100_sxm2_8x_query.csv"))
    Node.objects.filter(pk=simulated.pk).update(engine="sim")
    with app.connection_for_read() as connection:
        for node in (dgx, cpu_node, simulated):
            connection.SimpleQueue(node.queue).clear()
        with django_capture_on_commit_callbacks(execute=True):
            assert sample_gpu_health_all() == 1
        queue = connection.SimpleQueue(dgx.queue)
        message = queue.get(block=True, timeout=5)
        message.ack()
        assert message.headers["task"] == "inventory.sample_gpu_health"
        assert message.headers["expires"] is not None  # the next tick replaces a late one
        for node in (cpu_node, simulated):
            nothing = connection.SimpleQueue(node.queue)
            with pytest.raises(nothing.Empty):
                nothing.get(block=True, timeout=1)
