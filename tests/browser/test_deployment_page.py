"""The deployment page in Chromium: state, timeline, command line, sparklines and staff buttons."""

import math

import pytest
from playwright.sync_api import Page, expect

from portal.deployments.models import Deployment, DeploymentEvent, MetricsSample
from tests.helpers.browser import login, shot

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.browser]


@pytest.fixture
def serving(team, llama7b, profile_tp1, dgx):
    deployment = Deployment.objects.create(
        name="llama7b-a",
        team=team,
        model_version=llama7b,
        profile=profile_tp1,
        node=dgx,
        gpu_indices=[0],
        desired_state="running",
        state="serving",
        endpoint_url="http://10.0.0.5:8123",
        port=8123,
        pid=4242,
        command=[
            "/opt/vllm/bin/python",
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            "/models/llama-2-7b-chat-hf",
            "--served-model-name",
            "llama-2-7b-chat-hf",
            "--dtype",
            "float16",
            "--enforce-eager",
        ],
        log_tail="INFO:     Application startup complete.",
    )
    for step, seconds, message in [
        ("validate", 0.01, "planner: ok"),
        ("hashes", 41.2, "5 files match the release"),
        ("ready", 96.5, "llama-2-7b-chat-hf listed after 96.5 s"),
        ("smoke test", 0.4, "reply: 'Hello!'"),
        ("serving", 139.0, "serving at http://10.0.0.5:8123"),
    ]:
        DeploymentEvent.objects.create(
            deployment=deployment, step=step, status="ok", seconds=seconds, message=message
        )
    for i in range(30):
        MetricsSample.objects.create(
            deployment=deployment,
            healthy=True,
            running=8 + 6 * math.sin(i / 4),
            waiting=max(0, 3 * math.sin(i / 3)),
            kv_cache_usage=0.3 + 0.2 * math.sin(i / 5),
            generation_tokens=1000.0 * i,
            memory_mb=20_000 + 10 * i,
        )
    return deployment


def test_it_shows_a_serving_deployment_to_staff_with_its_controls(page: Page, live_server, alice, serving):
    login(page, live_server, "alice", "alice-password")
    page.goto(f"{live_server.url}/deployments/llama7b-a/")
    expect(page.locator("h1")).to_contain_text("serving")
    expect(page.get_by_role("button", name="Stop")).to_be_visible()
    expect(page.locator("pre.command")).to_contain_text("--served-model-name llama-2-7b-chat-hf")
    expect(page.locator("table.timeline")).to_contain_text("listed after 96.5 s")
    assert page.locator("svg.spark polyline").count() >= 4
    shot(page, "deployment")


def test_it_hides_the_controls_from_a_team_member(page: Page, live_server, bob, serving):
    login(page, live_server, "bob", "bob-password")
    page.goto(f"{live_server.url}/deployments/llama7b-a/")
    expect(page.locator("h1")).to_contain_text("serving")
    expect(page.get_by_role("button", name="Stop")).to_have_count(0)


def test_it_shows_the_stop_buttons_label_in_a_colour_a_person_can_read(
    page: Page, live_server, alice, serving
):
    from tests.helpers.browser import accessibility_violations

    login(page, live_server, "alice", "alice-password")
    page.goto(f"{live_server.url}/deployments/llama7b-a/")
    stop = page.get_by_role("button", name="Stop")
    colours = stop.evaluate("b => [getComputedStyle(b).color, getComputedStyle(b).backgroundColor]")
    assert colours[0] != colours[1]
    assert accessibility_violations(page) == []
