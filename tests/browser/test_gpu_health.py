"""GPU health in Chromium: the dashboard lists a degraded GPU, its node page shows each GPU's charts and
which deployment holds it, and staff mark the GPU healthy after a reset."""

from __future__ import annotations

import datetime as dt
import io

import pytest
from django.utils import timezone
from playwright.sync_api import Page, expect

from inference.gpu_health import Sample, parse_health_csv
from portal.inventory.services import node_record_gpu_health
from tests.helpers.browser import login, shot
from tests.helpers.samples import nvidia_smi_sample

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.browser]


@pytest.fixture
def sick_node(dgx, team, llama7b, profile_tp1):
    """Two hours of samples, a minute apart; the last one finds GPU 3's uncorrectable ECC errors."""
    from portal.deployments.services import deployment_create

    now = timezone.now()
    for minutes in range(120, 0, -1):
        sample = Sample(
            at=now - dt.timedelta(minutes=minutes),
            gpus=tuple(parse_health_csv(nvidia_smi_sample("health_v100_sxm2_8x_healthy.csv"))),
        )
        node_record_gpu_health(node=dgx, sample=sample)
    bad = parse_health_csv(nvidia_smi_sample("health_v100_sxm2_8x_ecc_uncorrectable.csv"))
    node_record_gpu_health(node=dgx, sample=Sample(at=now, gpus=tuple(bad)))
    deployment_create(
        name="chat-7b", team=team, model_version=llama7b, profile=profile_tp1, node=dgx, gpu_indices=[2]
    )
    return dgx


def test_ops_find_a_degraded_gpu_see_its_node_charts_and_mark_it_healthy(
    page: Page, live_server, alice, sick_node
):
    login(page, live_server, "alice", "alice-password")
    listed = page.locator("table#gpu-health")
    expect(listed).to_contain_text("dgx-v100-01:3")
    expect(listed).to_contain_text("uncorrectable ECC errors")

    listed.get_by_role("link", name="dgx-v100-01:3").click()
    expect(page.locator("h2#gpu-health")).to_be_visible()
    row = page.locator('tr.gpu-health-row[data-gpu="3"]')
    expect(row).to_have_attribute("data-state", "degraded")
    held = page.locator('tr.gpu-health-row[data-gpu="2"]')
    expect(held.get_by_role("link", name="chat-7b")).to_be_visible()
    usage = page.locator("svg#gpu-2-usage")
    expect(usage).to_be_visible()
    expect(usage).to_contain_text("GPU 2 · chat-7b")
    expect(usage.locator("polyline.series")).to_have_count(2)
    expect(usage.locator("line.sla-line")).to_have_attribute("data-value", "85")
    expect(page.locator("svg#gpu-7-power polyline.series")).to_have_count(2)
    shot(page, "node-gpu-health")

    page.get_by_role("button", name="Mark GPU 3 healthy (after a reset)").click()
    expect(page.locator('tr.gpu-health-row[data-gpu="3"]')).to_have_attribute("data-state", "healthy")
    expect(page.get_by_text("GPU 3 of dgx-v100-01 marked healthy")).to_be_visible()


def test_ops_rehearse_a_gpu_failure_on_a_simulated_node_and_see_it_on_its_page(
    page: Page, live_server, alice, dgx, team, llama7b, profile_tp1
):
    """docs/operators.md "Rehearsing a GPU failure": `manage.py inject_gpu_fault` beside `make run`, then the
    control worker's drain decides the move of the deployment on the GPU, and the pages show both."""
    from django.core.management import call_command

    from portal.deployments.gpu_drain import node_drain_sick_gpus
    from tests.helpers import builders

    dgx.engine = "sim"
    dgx.save(update_fields=["engine"])
    builders.deployment(
        name="chat-7b", team=team, model_version=llama7b, profile=profile_tp1, node=dgx, gpu_indices=[3],
        desired_state="running", state="serving", endpoint_url="http://127.0.0.1:9",
    )  # fmt: skip
    call_command("inject_gpu_fault", "--node", dgx.name, "--gpu", "3", "--kind", "ecc", stdout=io.StringIO())
    (decision,) = node_drain_sick_gpus(node=dgx)  # what `deployments.drain_sick_gpus` runs on control
    assert decision.action == "move"

    login(page, live_server, "alice", "alice-password")
    listed = page.locator("table#gpu-health")
    expect(listed).to_contain_text("dgx-v100-01:3")
    listed.get_by_role("link", name="dgx-v100-01:3").click()
    expect(page.locator('tr.gpu-health-row[data-gpu="3"]')).to_have_attribute("data-state", "degraded")
    expect(page.locator("tr.gpu-findings")).to_contain_text("uncorrectable ECC errors")
    page.goto(f"{live_server.url}/deployments/chat-7b/")
    expect(page.locator("table.timeline")).to_contain_text("GPU 3 is degraded")
    page.goto(f"{live_server.url}/nodes/{dgx.name}/")
    page.get_by_role("button", name="Mark GPU 3 healthy (after a reset)").click()
    expect(page.locator('tr.gpu-health-row[data-gpu="3"]')).to_have_attribute("data-state", "healthy")
