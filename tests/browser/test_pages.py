"""The portal's pages in headless Chromium against a live server.

Each test builds its data first (fixtures, `seed_demo`), then drives the page the
way a person would, and leaves a full-page screenshot in test-artifacts/screenshots.
"""

from __future__ import annotations

import re

import pytest
from django.core.management import call_command
from playwright.sync_api import Page, expect

from tests.helpers.browser import login, shot

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def card_value(page: Page, label: str):
    """The big number on the front-page card labelled `label`."""
    label_div = page.locator(".muted", has_text=re.compile(f"^{label}$"))
    return page.locator(".card").filter(has=label_div).locator(".big")


def test_it_sends_an_anonymous_visitor_to_log_in_and_back_to_the_planner(page: Page, live_server, bob):
    page.goto(f"{live_server.url}/planner/")

    expect(page).to_have_url(re.compile(r"/accounts/login/\?next=/planner/$"))
    expect(page.locator("form.login h1")).to_have_text("Log in")
    page.fill("#id_username", "bob")
    page.fill("#id_password", "bob-password")
    page.get_by_role("button", name="Log in").click()

    expect(page).to_have_url(f"{live_server.url}/planner/")
    expect(page.get_by_role("heading", name="Capacity planner")).to_be_visible()
    expect(page.locator("header.top")).to_contain_text("bob")


def test_it_shows_why_a_bf16_profile_is_refused_on_v100(page: Page, live_server, alice):
    call_command("seed_demo", verbosity=0)
    login(page, live_server, "alice", "alice-password")

    page.goto(f"{live_server.url}/profiles/example-bf16-on-v100/")

    expect(page.get_by_role("heading", name="Profile example-bf16-on-v100")).to_be_visible()
    expect(page.locator(".verdict")).to_have_class(re.compile(r"\brefused\b"))
    expect(page.locator(".verdict")).to_contain_text("Refused")
    finding = page.locator("li.finding.error").filter(has=page.locator("code", has_text="bf16_unsupported"))
    expect(finding).to_have_count(1)
    expect(finding).to_contain_text("float16")
    shot(page, "profile-refused")


def test_it_shows_an_accepted_fp16_tp8_profile_with_its_weights_per_gpu(page: Page, live_server, alice):
    call_command("seed_demo", verbosity=0)
    login(page, live_server, "alice", "alice-password")

    page.goto(f"{live_server.url}/profiles/v100-7b-fp16-tp8/")

    expect(page.locator(".verdict")).to_have_class(re.compile(r"\bok\b"))
    expect(page.locator(".verdict")).to_have_text("The planner accepts this placement.")
    expect(page.locator("li.finding.error")).to_have_count(0)
    weights_th = page.locator("table.plan th", has_text="Weights per GPU")
    weights = weights_th.locator("xpath=following-sibling::td[1]")
    expect(weights).to_have_text(re.compile(r"^\s*1\.(6[5-9]|7[0-4]) GB\s*$"))
    shot(page, "profile-ok")


def test_it_plans_bf16_as_refused_then_fp16_eager_as_ok(page: Page, live_server, alice, qwen_bf16):
    login(page, live_server, "alice", "alice-password")
    page.goto(f"{live_server.url}/planner/")
    expect(page.locator(".verdict")).to_have_count(0)

    page.select_option("#id_model", value="qwen2.5-7b-instruct")
    page.select_option("#id_gpu", value="v100-sxm2-32gb")
    page.fill("#id_gpus", "1")
    page.select_option("#id_dtype", value="bfloat16")
    page.get_by_role("button", name="Plan").click()

    expect(page.locator(".verdict")).to_have_class(re.compile(r"\brefused\b"))
    bf16 = page.locator("li.finding.error").filter(has=page.locator("code", has_text="bf16_unsupported"))
    expect(bf16).to_be_visible()
    # A GET form: the choices survive the round trip, in the URL and in the fields.
    assert "dtype=bfloat16" in page.url
    expect(page.locator("#id_model")).to_have_value("qwen2.5-7b-instruct")
    expect(page.locator("#id_dtype")).to_have_value("bfloat16")

    page.select_option("#id_dtype", value="float16")
    page.check("#id_enforce_eager")
    page.get_by_role("button", name="Plan").click()

    expect(page.locator(".verdict")).to_have_class(re.compile(r"\bok\b"))
    expect(page.locator(".verdict")).to_have_text("The planner accepts this placement.")
    expect(page.locator("li.finding code", has_text="bf16_unsupported")).to_have_count(0)
    expect(page.locator("li.finding.error")).to_have_count(0)
    assert "dtype=float16" in page.url
    expect(page.locator("#id_enforce_eager")).to_be_checked()
    shot(page, "planner")


def test_it_lists_the_gpus_of_a_dgx_node_with_their_nvlink_peers(page: Page, live_server, alice, dgx):
    login(page, live_server, "alice", "alice-password")

    page.goto(f"{live_server.url}/nodes/dgx-v100-01/")

    expect(page.get_by_role("heading", name="Node dgx-v100-01")).to_be_visible()
    gpu_table = page.locator("table").filter(has=page.locator("th", has_text="NVLink peers"))
    rows = gpu_table.locator("tr").filter(has=page.locator("td"))
    expect(rows).to_have_count(8)
    gpu0 = rows.nth(0).locator("td")
    expect(gpu0.nth(0)).to_have_text("0")
    expect(gpu0.nth(1)).to_contain_text("V100")
    expect(gpu0.nth(6)).to_have_text("1, 2, 3, 4")
    shot(page, "node")


def test_it_counts_nodes_and_models_on_the_front_page(page: Page, live_server, alice):
    call_command("seed_demo", verbosity=0)
    login(page, live_server, "alice", "alice-password")

    page.goto(f"{live_server.url}/")

    expect(page.get_by_role("heading", name="Overview")).to_be_visible()
    expect(card_value(page, "Nodes")).to_have_text("3")
    expect(card_value(page, "Model versions")).to_have_text("5")
    expect(card_value(page, "GPUs")).to_have_text("9")
    for node in ("dgx-v100-01", "pcie-v100-01", "local"):
        expect(page.get_by_role("link", name=node, exact=True)).to_be_visible()
    shot(page, "home")
