"""A new operator's first hour in Chromium: adding a node in the portal, the new key's snippets, and
the planner's eager box following the GPU."""

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


def test_it_adds_a_node_in_the_portal_keeping_a_refused_paste(page: Page, live_server, alice):
    from portal.inventory.models import Node

    login(page, live_server, "alice", "alice-password", next_path="/nodes/")
    page.get_by_role("link", name="Add a node").click()
    expect(page.get_by_role("heading", name="Add a node")).to_be_visible()
    page.fill("#id_name", "dgx-v100-02")
    page.fill("#id_nvidia_smi_query", nvidia_smi_sample("v100_sxm2_8x_query.csv"))
    page.fill("#id_nvidia_smi_topology", "GPU0\tGPU1\nnot a matrix\n")
    page.get_by_role("button", name="Add the node").click()
    expect(page.locator("main")).to_contain_text("topology (`nvidia-smi topo -m`)")
    expect(page.locator("#id_nvidia_smi_topology")).to_have_value("GPU0\tGPU1\nnot a matrix\n")
    shot(page, "node-new-refused")
    assert not Node.objects.filter(name="dgx-v100-02").exists()

    page.fill("#id_nvidia_smi_topology", nvidia_smi_sample("v100_sxm2_8x_topo.txt"))
    page.get_by_role("button", name="Add the node").click()
    expect(page.get_by_role("heading", name="Node dgx-v100-02")).to_be_visible()
    expect(page.locator("main")).to_contain_text("added with 8 GPUs")
    assert Node.objects.get(name="dgx-v100-02").gpus.count() == 8


def test_it_shows_the_new_keys_base_url_and_snippets(page: Page, live_server, bob, team, llama7b):
    login(page, live_server, "bob", "bob-password", next_path="/teams/search/keys/")
    page.fill("#id_name", "notebook")
    page.fill("#id_models", "llama-2-7b-chat-hf")
    page.get_by_role("button", name="Create key").click()
    token = page.locator("#new-key").inner_text().strip()
    expect(page.locator("#base-url")).to_have_text(f"{live_server.url}/v1")
    expect(page.locator("#snippet-curl")).to_contain_text(f"Authorization: Bearer {token}")
    expect(page.locator("#snippet-python")).to_contain_text(f'api_key="{token}"')
    expect(page.locator("#snippet-python")).to_contain_text('model="llama-2-7b-chat-hf"')
    shot(page, "team-key-snippets")


def test_it_turns_enforce_eager_on_for_volta_and_off_for_others(page: Page, live_server, bob):
    login(page, live_server, "bob", "bob-password", next_path="/planner/")
    eager = page.locator("#id_enforce_eager")
    expect(eager).to_be_checked()  # the default GPU is a V100
    page.select_option("#id_gpu", "a100-sxm4-80gb")
    expect(eager).not_to_be_checked()
    page.select_option("#id_gpu", "v100-pcie-16gb")
    expect(eager).to_be_checked()
