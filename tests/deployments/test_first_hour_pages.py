"""What a new operator's first hour showed on the planner, profile and benchmark pages."""

from __future__ import annotations

import re
from urllib.parse import parse_qs, urlsplit

import pytest
from django.core.management import call_command

pytestmark = pytest.mark.django_db


@pytest.fixture
def demo(db):
    call_command("seed_demo")


def checkbox(page: str, name: str) -> str:
    return re.search(rf'<input type="checkbox" name="{name}"[^>]*>', page).group(0)


def test_it_checks_enforce_eager_by_default_on_a_volta_gpu(client, bob, demo):
    client.force_login(bob)
    page = client.get("/planner/").content.decode()
    assert "checked" in checkbox(page, "enforce_eager")
    assert "v100-sxm2-32gb" in re.search(r'data-eager-gpus="([^"]*)"', page)[1].split()


def test_it_leaves_enforce_eager_as_a_profile_has_it(client, bob, demo):
    client.force_login(bob)
    page = client.get("/planner/?profile=example-bf16-on-v100").content.decode()
    from portal.deployments.models import DeploymentProfile

    eager = DeploymentProfile.objects.get(name="example-bf16-on-v100").enforce_eager
    assert ("checked" in checkbox(page, "enforce_eager")) == eager


def test_it_starts_the_planner_from_a_nodes_gpus(client, bob, demo):
    client.force_login(bob)
    node_page = client.get("/nodes/dgx-v100-01/").content.decode()
    assert "/planner/?node=dgx-v100-01" in node_page
    form = client.get("/planner/?node=dgx-v100-01").context["form"]
    assert (form.initial["gpu"], form.initial["gpus"], form.initial["interconnect"]) == (
        "v100-sxm2-32gb",
        8,
        "nvlink",
    )


def test_it_turns_an_accepted_plan_into_a_prefilled_profile_form(admin_client, demo):
    query = {
        "model": "llama-2-7b-chat-hf",
        "gpu": "v100-sxm2-32gb",
        "gpus": 1,
        "dtype": "float16",
        "gpu_memory_utilization": 0.9,
        "max_num_seqs": 16,
        "block_size": 16,
        "enforce_eager": "on",
    }
    response = admin_client.get("/planner/", query)
    assert response.context["plan"]["ok"]
    link = response.context["profile_link"]
    assert urlsplit(link).path == "/admin/deployments/deploymentprofile/add/"
    sent = parse_qs(urlsplit(link).query)
    assert sent["target_gpu"] == ["v100-sxm2-32gb"] and sent["enforce_eager"] == ["on"]
    assert "enable_prefix_caching" not in sent  # the admin would read any value as checked
    form = admin_client.get(link).context["adminform"].form
    assert form.initial["max_num_seqs"] == "16"
    assert form.initial["name"] == "llama-2-7b-chat-hf-v100-sxm2-32gb-tp1"


def test_it_offers_no_profile_link_to_members_or_for_bundled_configs(client, bob, admin_client, demo):
    client.force_login(bob)
    query = {"model": "llama-2-7b-chat-hf", "gpu": "v100-sxm2-32gb", "gpus": 1, "dtype": "float16",
             "gpu_memory_utilization": 0.9, "max_num_seqs": 16, "block_size": 16}  # fmt: skip
    assert client.get("/planner/", query).context["profile_link"] is None
    bundled = {**query, "model": "mistral-7b-instruct-v0.3"}
    response = admin_client.get("/planner/", bundled)
    assert response.context["plan"]["ok"] and response.context["profile_link"] is None


def test_it_names_findings_on_the_profiles_list_instead_of_their_codes(client, bob, demo):
    client.force_login(bob)
    page = client.get("/profiles/").content.decode()
    assert "no bf16 on this GPU" in page
    assert not re.search(r'class="badge (warning|error)"[^>]*>[a-z0-9]+(_[a-z0-9]+)+<', page)


def test_it_splits_the_levels_table_so_each_part_fits_the_page():
    from portal.benchmarks.views import _level_tables

    headers = ["concurrency", "output tok/s", "P95 TTFT ms", "mean TPOT ms", "P95 ITL ms", "preemptions"]
    rows = [["16", "900.0", "700.0", "38.25", "40.00", "0"]]
    assert _level_tables(headers, rows) == [
        (["concurrency", "output tok/s", "P95 TTFT ms"], [["16", "900.0", "700.0"]]),
        (["concurrency", "mean TPOT ms", "P95 ITL ms", "preemptions"], [["16", "38.25", "40.00", "0"]]),
    ]
    short = (["concurrency", "completed"], [["1", "2"]])
    assert _level_tables(*short) == [short]


def test_it_points_the_planners_footer_at_the_new_deployment_page(admin_client, demo):
    query = {"model": "llama-2-7b-chat-hf", "gpu": "v100-sxm2-32gb", "gpus": 1, "dtype": "float16",
             "gpu_memory_utilization": 0.9, "max_num_seqs": 16, "block_size": 16,
             "enforce_eager": "on"}  # fmt: skip
    page = admin_client.get("/planner/", query).content.decode()
    assert 'href="/deployments/new/"' in page
    assert "Admin → Deployments" not in page
