"""The ops dashboard lists the GPUs whose last health sample found something, worst first."""

from __future__ import annotations

import pytest
from django.utils import timezone

from inference.gpu_health import Sample, parse_health_csv
from portal.inventory.services import node_record_gpu_health
from tests.helpers.samples import nvidia_smi_sample

pytestmark = pytest.mark.django_db


def _record(node, fixture: str, at) -> None:
    sample = Sample(at=at, gpus=tuple(parse_health_csv(nvidia_smi_sample(fixture))))
    node_record_gpu_health(node=node, sample=sample)


def test_the_dashboard_lists_the_gpus_not_healthy_worst_first_with_their_holders(
    client, alice, dgx, team, llama7b, profile_tp1
):
    from portal.deployments.services import deployment_create

    deployment_create(
        name="kept-7b", team=team, model_version=llama7b, profile=profile_tp1, node=dgx, gpu_indices=[4]
    )
    _record(dgx, "health_v100_sxm2_8x_gpu4_missing.csv", timezone.now())
    hot = {"level": "warning", "code": "hot", "message": "GPU 6 is at 88 °C"}
    dgx.gpus.filter(index=6).update(health_state="warning", health_findings=[hot])
    client.force_login(alice)
    page = client.get("/").content.decode()
    section = page[page.index('id="gpu-health"') :]
    assert section.index("dgx-v100-01:4") < section.index("dgx-v100-01:6")
    assert "did not answer" in section and "GPU 6 is at 88 °C" in section
    rows = section.split("<tr")
    assert '<a href="/deployments/kept-7b/">kept-7b</a>' in next(r for r in rows if "dgx-v100-01:4" in r)
    assert "free" in next(r for r in rows if "dgx-v100-01:6" in r)
