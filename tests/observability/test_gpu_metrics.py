"""/metrics exports each GPU's latest health sample under DCGM's names, and its health state."""

from __future__ import annotations

import datetime as dt

import pytest
from django.utils import timezone

from inference.gpu_health import Sample, parse_health_csv
from portal.inventory.services import node_record_gpu_health
from tests.helpers.metrics import TOKEN, scrape, value
from tests.helpers.samples import nvidia_smi_sample

pytestmark = pytest.mark.django_db


def _record(node, fixture: str, at: dt.datetime) -> None:
    sample = Sample(at=at, gpus=tuple(parse_health_csv(nvidia_smi_sample(fixture))))
    node_record_gpu_health(node=node, sample=sample)


def test_it_exports_the_latest_sample_under_dcgm_names_and_the_health_state(
    client, settings, metrics_redis, dgx
):
    settings.PORTAL_METRICS_TOKEN = TOKEN
    now = timezone.now()
    _record(dgx, "health_v100_sxm2_8x_healthy.csv", now - dt.timedelta(minutes=2))
    _record(dgx, "health_v100_sxm2_8x_throttling.csv", now)
    samples = scrape(client)
    gpu2 = {"node": "dgx-v100-01", "gpu": "2", "UUID": "GPU-c25d8e4a-0b17-6f39-a4e2-9d1c7b3f5a86",
            "modelName": "Tesla V100-SXM2-32GB"}  # fmt: skip
    assert value(samples, "portal_dcgm_fi_dev_gpu_temp", **gpu2) == 89
    assert value(samples, "portal_dcgm_fi_dev_gpu_util", **gpu2) == 87
    assert value(samples, "portal_dcgm_fi_dev_fb_used", **gpu2) == 29834
    assert value(samples, "portal_dcgm_fi_dev_power_usage", **gpu2) == 211.45
    assert value(samples, "portal_dcgm_fi_dev_sm_clock", **gpu2) == 1125
    assert value(samples, "portal_dcgm_fi_dev_clock_throttle_reasons", **gpu2) == 0x60
    assert value(samples, "portal_dcgm_fi_dev_ecc_dbe_vol_total", **gpu2) == 0
    assert value(samples, "portal_dcgm_fi_dev_pcie_max_link_width", **gpu2) == 16
    assert value(samples, "portal_gpu_health", **gpu2, state="warning") == 1  # 89 °C
    assert value(samples, "portal_gpu_health", **gpu2, state="healthy") == 0
    # [N/A] on Volta (it retires pages; row remapping came with Ampere): no sample rather than a 0.
    assert ("portal_dcgm_fi_dev_row_remap_pending", tuple(sorted(gpu2.items()))) not in samples


def test_a_gpu_without_a_fresh_sample_exports_its_state_but_no_readings(client, settings, metrics_redis, dgx):
    settings.PORTAL_METRICS_TOKEN = TOKEN
    _record(dgx, "health_v100_sxm2_8x_healthy.csv", timezone.now() - dt.timedelta(hours=1))
    samples = scrape(client)
    assert not [name for name, _labels in samples if name == "portal_dcgm_fi_dev_gpu_temp"]
    assert sum(v for (name, _), v in samples.items() if name == "portal_gpu_health") == 8
