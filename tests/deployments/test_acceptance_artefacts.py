"""What node acceptance leaves behind (a reference model, its profile, a stopped deployment of the
acceptance team) stays out of the main lists and the planner's defaults, one click away."""

from __future__ import annotations

import pytest

from portal.registry.services import model_version_create
from tests.helpers import builders
from tests.helpers.samples import bundled_config

pytestmark = pytest.mark.django_db


@pytest.fixture
def artefacts(cpu_node):
    version = model_version_create(
        name="accept-tiny-fp32", config=bundled_config("llama-2-7b-chat-hf"), source="node acceptance (tiny)"
    )
    profile = builders.profile(
        name="accept-local-1", model_version=version, dtype="float32", description="node acceptance 1"
    )
    team = builders.team(name="Node acceptance", slug="acceptance", gpu_quota=1024)
    builders.deployment(
        name="accept-local-1", team=team, model_version=version, profile=profile, node=cpu_node,
        desired_state="stopped", state="stopped",
    )  # fmt: skip
    return version


def test_the_lists_leave_them_out_and_link_to_them(client, alice, artefacts, llama7b, profile_tp8):
    client.force_login(alice)
    for path, kept in (("/models/", "llama-2-7b-chat-hf"), ("/profiles/", "v100-7b-fp16-tp8")):
        page = client.get(path).content.decode()
        assert "accept-" not in page.replace('href="?acceptance=show"', "") and kept in page
        assert 'href="?acceptance=show"' in page
        shown = client.get(f"{path}?acceptance=show").content.decode()
        assert "accept-tiny-fp32" in shown and kept not in shown.split("<table")[1]
    page = client.get("/deployments/").content.decode()
    assert "accept-local-1" not in page and "1 deployments from node acceptance" in page
    assert "accept-local-1" in client.get("/deployments/?acceptance=show").content.decode()
    assert "accept-local-1" not in client.get("/").content.decode()


def test_the_planner_defaults_to_a_real_model(client, alice, artefacts, llama7b):
    client.force_login(alice)
    form = client.get("/planner/").context["form"]
    groups = dict(form.fields["model"].choices)
    assert groups["Registered"][0][0] == "llama-2-7b-chat-hf"
    assert "accept-tiny-fp32" in dict(groups["Node acceptance reference models"])


def test_the_create_deployment_form_does_not_offer_them(client, alice, artefacts):
    client.force_login(alice)
    form = client.get("/deployments/new/").context["form"]
    assert not form.fields["model_version"].queryset.filter(name="accept-tiny-fp32").exists()
    assert not form.fields["profile"].queryset.filter(name="accept-local-1").exists()
    assert not form.fields["team"].queryset.filter(slug="acceptance").exists()
