"""The operator's first hour, second pass, in Chromium: the add-a-node form's layout and its stored
topology, the node's agent heartbeat, the portal's own "Create a deployment" page, and the friendly
pages for ordinary mistakes (compare with nothing picked, a form whose session expired, a mistyped
gateway path)."""

from __future__ import annotations

import pytest
from playwright.sync_api import Page, expect

from tests.helpers.browser import login, shot
from tests.helpers.samples import nvidia_smi_sample

pytestmark = [
    pytest.mark.browser,
    pytest.mark.django_db(transaction=True),
    pytest.mark.usefixtures("gateway_redis_db"),
]


def _box(page: Page, selector: str) -> dict:
    box = page.locator(selector).bounding_box()
    assert box is not None, selector
    return box


def test_the_add_a_node_form_lays_out_its_text_boxes_and_keeps_the_topology_aligned(
    page: Page, live_server, alice
):
    login(page, live_server, "alice", "alice-password", next_path="/nodes/new/")
    page.fill("#id_name", "dgx-v100-02")
    page.fill("#id_nvidia_smi_query", nvidia_smi_sample("v100_sxm2_8x_query.csv"))
    page.fill("#id_nvidia_smi_topology", "GPU0\tGPU1\nnot a matrix\n")
    page.get_by_role("button", name="Add the node").click()
    expect(page.locator("main")).to_contain_text("topology (`nvidia-smi topo -m`)")
    shot(page, "node-new-layout-refused")

    csv, topo = _box(page, "#id_nvidia_smi_query"), _box(page, "#id_nvidia_smi_topology")
    form = _box(page, "form.node-new")
    assert csv["width"] > 0.85 * form["width"]  # a text box takes the whole row
    assert topo["y"] >= csv["y"] + csv["height"] + 8  # the topology box sits clearly below the CSV
    # The error and the help text under the topology box stack, neither over the other.
    field = page.locator(".field", has=page.locator("#id_nvidia_smi_topology"))
    error, help_text = field.locator(".errorlist").bounding_box(), field.locator(".help").bounding_box()
    assert error["y"] >= topo["y"] + topo["height"] and help_text["y"] >= error["y"] + error["height"]

    page.fill("#id_nvidia_smi_topology", nvidia_smi_sample("v100_sxm2_8x_topo.txt"))
    page.get_by_role("button", name="Add the node").click()
    expect(page.get_by_role("heading", name="Node dgx-v100-02")).to_be_visible()
    topology = page.locator("pre.topology")
    assert topology.text_content().startswith("\tGPU0\tGPU1")  # the header's leading tab is kept
    # No agent has answered for the new node: the page says so and how to start one.
    expect(page.locator(".no-agent")).to_contain_text("celery -A portal worker -Q node.dgx-v100-02")
    shot(page, "node-page-agent-and-topology")


def test_staff_create_a_deployment_in_the_portal(
    page: Page, live_server, alice, team, llama7b, profile_tp1, dgx
):
    from portal.deployments.models import Deployment

    login(page, live_server, "alice", "alice-password", next_path="/deployments/")
    page.get_by_role("link", name="Create a deployment").click()
    expect(page.get_by_role("heading", name="Create a deployment")).to_be_visible()
    expect(page.locator("#id_desired_state")).to_have_value("running")
    page.fill("#id_name", "search-7b")
    page.select_option("#id_team", label=team.name)
    page.select_option("#id_model_version", label=llama7b.name)
    page.select_option("#id_profile", label=profile_tp1.name)
    page.select_option("#id_node", label=dgx.name)
    page.fill("#id_gpu_indices", "0-1")  # two GPUs for a one-GPU profile: refused beside the field
    page.get_by_role("button", name="Create the deployment").click()
    field = page.locator(".field", has=page.locator("#id_gpu_indices"))
    expect(field.locator(".errorlist")).to_contain_text("tensor parallel size 1")
    shot(page, "deployment-new-refused")
    assert not Deployment.objects.exists()

    page.fill("#id_gpu_indices", "")
    page.locator("label.gpu-box", has_text="3").locator("input").check()
    page.get_by_role("button", name="Create the deployment").click()
    expect(page.get_by_role("heading", name="Deployment search-7b")).to_be_visible()
    expect(page.locator("main")).to_contain_text("deployment search-7b created")
    shot(page, "deployment-new-created")
    deployment = Deployment.objects.get(name="search-7b")
    assert deployment.gpu_indices == [3] and deployment.desired_state == "running"


def test_ordinary_mistakes_get_friendly_pages(page: Page, live_server, alice):
    from portal.benchmarks.models import BenchmarkRun

    BenchmarkRun.objects.create(
        mix="short-qa", state="done", endpoint_url="http://127.0.0.1:9", model_name="m",
        snapshot={"profile": {"name": "cpu-tiny"}},
    )  # fmt: skip
    login(page, live_server, "alice", "alice-password", next_path="/benchmarks/")
    page.get_by_role("button", name="Compare A and B").click()
    expect(page.locator(".messages")).to_contain_text("pick one run as A and another as B")
    expect(page.locator("body")).not_to_contain_text("URLconf")
    shot(page, "compare-nothing-picked")

    page.goto(f"{live_server.url}/nodes/new/")
    page.context.clear_cookies()  # the session ends (logged out elsewhere, a restart) while the form is open
    page.fill("#id_name", "late-node")
    page.get_by_role("button", name="Add the node").click()
    expect(page.get_by_role("heading", name="Your session expired")).to_be_visible()
    expect(page.locator("body")).not_to_contain_text("CSRF verification failed")
    shot(page, "csrf-session-expired")

    response = page.request.post(f"{live_server.url}/v1/chat/completion", data="{}")
    assert response.status == 404 and response.headers["content-type"] == "application/json"
    assert "Did you mean /v1/chat/completions?" in response.json()["error"]["message"]
    favicon = page.request.get(f"{live_server.url}/favicon.ico")
    assert favicon.ok and favicon.body()[:4] == b"\x00\x00\x01\x00"


def test_a_pending_deployment_and_a_cpu_node_say_what_is_missing(
    page: Page, live_server, alice, team, llama7b, cpu_node, settings
):
    from datetime import timedelta

    from django.utils import timezone

    from portal.deployments.models import Deployment, DeploymentEvent, DeploymentProfile

    settings.DEPLOYMENT_PENDING_WARN_S = 30
    profile = DeploymentProfile.objects.create(name="cpu-7b", model_version=llama7b, dtype="float32")
    deployment = Deployment.objects.create(
        name="waits", team=team, model_version=llama7b, profile=profile, node=cpu_node,
        desired_state="running", state="pending",
    )  # fmt: skip
    DeploymentEvent.objects.create(deployment=deployment, step="created", status="info", message="created")
    DeploymentEvent.objects.filter(deployment=deployment).update(at=timezone.now() - timedelta(minutes=5))

    login(page, live_server, "alice", "alice-password", next_path="/deployments/waits/")
    waiting = page.locator("table.timeline tr.unclaimed")
    expect(waiting).to_contain_text("No agent has picked this up for 5 min")
    expect(waiting).to_contain_text(f"celery -A portal worker -Q node.{cpu_node.name}")
    shot(page, "deployment-pending-unclaimed")

    page.goto(f"{live_server.url}/nodes/{cpu_node.name}/")
    expect(page.locator("#id_shape")).to_have_value("tiny")
    expect(page.locator("#id_predict_gpu option:checked")).to_contain_text("no GPU")
    expect(page.locator("form.accept-form")).to_contain_text("2 to 4 levels of concurrent users")
    shot(page, "node-cpu-acceptance-form")
