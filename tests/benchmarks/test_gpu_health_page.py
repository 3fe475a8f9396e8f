"""The node page's GPU health section: state, findings, holder, latest readings, charts, mark healthy."""

from __future__ import annotations

import datetime as dt

import pytest
from django.utils import timezone

from inference.gpu_health import Sample, parse_health_csv
from portal.audit.models import AuditEvent
from portal.inventory.services import node_record_gpu_health
from tests.helpers.samples import nvidia_smi_sample

pytestmark = pytest.mark.django_db


def _record(node, fixture: str, at: dt.datetime) -> None:
    sample = Sample(at=at, gpus=tuple(parse_health_csv(nvidia_smi_sample(fixture))))
    node_record_gpu_health(node=node, sample=sample)


@pytest.fixture
def sampled(dgx, team, llama7b, profile_tp1):
    from portal.deployments.services import deployment_create

    now = timezone.now()
    for minutes, fixture in ((20, "healthy"), (10, "healthy"), (0, "ecc_uncorrectable")):
        _record(dgx, f"health_v100_sxm2_8x_{fixture}.csv", now - dt.timedelta(minutes=minutes))
    deployment_create(
        name="chat-7b", team=team, model_version=llama7b, profile=profile_tp1, node=dgx, gpu_indices=[2]
    )
    return dgx


def test_the_node_page_shows_each_gpus_health_holder_readings_and_charts(client, bob, sampled):
    client.force_login(bob)
    page = client.get(sampled.get_absolute_url()).content.decode()
    assert 'id="gpu-health"' in page
    assert 'data-gpu="3" data-state="degraded"' in page and 'data-gpu="2" data-state="healthy"' in page
    assert "uncorrectable ECC errors since its last reset" in page
    assert '<a href="/deployments/chat-7b/">chat-7b</a>' in page
    assert 'id="gpu-2-usage"' in page and 'id="gpu-2-power"' in page
    assert "GPU 2 · chat-7b" in page and "GPU 3 · free" in page
    assert page.count('class="series"') >= 8 * 2
    assert "Mark GPU 3 healthy" not in page  # staff only


def test_staff_mark_a_gpu_healthy_from_the_node_page(client, alice, bob, sampled):
    url = f"{sampled.get_absolute_url()}gpus/3/mark-healthy/"
    client.force_login(bob)
    assert client.post(url).status_code == 403
    client.force_login(alice)
    page = client.get(sampled.get_absolute_url()).content.decode()
    assert "Mark GPU 3 healthy (after a reset)" in page
    response = client.post(url)
    assert response.status_code == 302
    assert sampled.gpus.get(index=3).health_state == "healthy"
    assert AuditEvent.objects.filter(action="gpu.mark_healthy", actor=alice).exists()


def test_a_non_finite_reading_is_never_stored_and_the_node_page_still_renders(client, bob, dgx):
    """Issue 35 item 12: nvidia-smi printed `inf`; derived from the committed node by replacing a value,
    once in the text and once in a reading another caller built."""
    from dataclasses import replace

    from portal.inventory.models import GpuSample

    text = nvidia_smi_sample("health_v100_sxm2_8x_healthy.csv").replace("211.45", "inf", 1)
    gpus = list(parse_health_csv(text))
    gpus[1] = replace(gpus[1], temperature_c=float("nan"))
    node_record_gpu_health(node=dgx, sample=Sample(at=timezone.now(), gpus=tuple(gpus)))
    assert GpuSample.objects.get(gpu__node=dgx, gpu__index=0).power_draw_w is None
    assert GpuSample.objects.get(gpu__node=dgx, gpu__index=1).temperature_c is None
    client.force_login(bob)
    response = client.get(dgx.get_absolute_url())
    assert response.status_code == 200 and 'data-gpu="0"' in response.content.decode()


def test_the_node_page_says_which_checks_its_driver_cannot_answer(client, bob, dgx):
    sample = Sample(
        at=timezone.now(),
        gpus=tuple(parse_health_csv(nvidia_smi_sample("health_v100_sxm2_8x_healthy.csv"))),
        unsupported_fields=("remapped_rows.correctable", "remapped_rows.pending"),
    )
    node_record_gpu_health(node=dgx, sample=sample)
    client.force_login(bob)
    page = client.get(dgx.get_absolute_url()).content.decode()
    assert 'id="gpu-health-unknown-checks"' in page
    assert "does not know remapped_rows.correctable, remapped_rows.pending: row remapping" in page
    assert set(dgx.gpus.values_list("health_state", flat=True)) == {"healthy"}
