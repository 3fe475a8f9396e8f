"""The audit log: one test per kind of action, each through the path a person uses, and the
log itself is append-only (the model refuses changes; the admin only lists)."""

from __future__ import annotations

import io

import pytest
from django.core.management import call_command
from django.test import Client

from portal.audit.models import AppendOnlyError, AuditEvent
from portal.benchmarks.models import BenchmarkRun
from portal.deployments.models import Deployment
from portal.teams.models import ApiKey, Team
from portal.teams.services import api_key_create
from tests.helpers import builders
from tests.helpers.clients import api_client
from tests.helpers.samples import bundled_config, nvidia_smi_sample

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("gateway_redis_db")]


@pytest.fixture
def admin_user(django_user_model):
    return django_user_model.objects.create_superuser("root", "root@example.com", "root-password")


@pytest.fixture
def deployment(team, llama7b, profile_tp8, dgx):
    return builders.deployment(
        name="search-llama", team=team, model_version=llama7b, profile=profile_tp8, node=dgx,
        gpu_indices=list(range(8)), desired_state="stopped", state="stopped",
    )  # fmt: skip


def logged_in(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def only(action: str) -> AuditEvent:
    events = list(AuditEvent.objects.filter(action=action))
    assert len(events) == 1, [str(e) for e in AuditEvent.objects.all()]
    return events[0]


# --- the portal's own actions -------------------------------------------------------------


@pytest.mark.parametrize("action", ["start", "stop", "restart"])
def test_deployment_actions_from_the_page_are_recorded(alice, deployment, action):
    if action == "restart":
        Deployment.objects.filter(pk=deployment.pk).update(desired_state="running")
    response = logged_in(alice).post(f"/deployments/search-llama/{action}/")
    assert response.status_code == 302
    event = only(f"deployment.{action}")
    assert (event.actor, event.actor_repr, event.ip) == (alice, "alice", "127.0.0.1")
    assert (event.target_type, event.target_id, event.target_repr) == (
        "deployments.deployment", str(deployment.pk), "search-llama",
    )  # fmt: skip


def test_a_refused_deployment_action_is_not_recorded(bob, deployment):
    assert logged_in(bob).post("/deployments/search-llama/start/").status_code == 403
    assert not AuditEvent.objects.exists()


def test_deployment_actions_from_the_api_are_recorded(alice, deployment):
    assert api_client(alice).post("/api/v1/deployments/search-llama/start/").status_code == 202
    assert only("deployment.start").actor == alice


def test_applying_the_sla_cap_is_recorded_with_the_values(alice, deployment):
    run = BenchmarkRun.objects.create(
        deployment=deployment, mix="short-qa", state="succeeded", sla_concurrency=16, created_by=alice
    )
    assert api_client(alice).post(f"/api/v1/benchmark-runs/{run.pk}/apply-cap/").status_code == 200
    event = only("deployment.set_cap")
    assert event.actor == alice
    assert event.changes["concurrency_cap"] == [None, 16]
    assert f"benchmark run {run.pk}" in event.changes["source"]


def test_a_key_created_and_revoked_by_a_member_is_recorded(bob, team):
    client = logged_in(bob)
    assert client.post("/teams/search/keys/", {"name": "ci"}).status_code == 200
    key = ApiKey.objects.get(team=team)
    created = only("api_key.create")
    assert (created.actor, created.target_id, created.ip) == (bob, str(key.pk), "127.0.0.1")
    assert created.changes == {"team": "search", "name": "ci", "allowed_models": [], "priority_class": ""}
    assert client.post(f"/teams/search/keys/{key.prefix}/revoke/").status_code == 302
    revoked = only("api_key.revoke")
    assert (revoked.actor, revoked.target_id) == (bob, str(key.pk))
    # Revoking again changes nothing, so it is not recorded again.
    client.post(f"/teams/search/keys/{key.prefix}/revoke/")
    assert AuditEvent.objects.filter(action="api_key.revoke").count() == 1


def test_no_secret_reaches_the_log(bob, team):
    key, token = api_key_create(team=team, name="batch")
    text = str(list(AuditEvent.objects.values()))
    assert token.split(".", 1)[1] not in text and key.digest not in text


def test_a_key_created_by_the_command_is_recorded_as_system(team):
    call_command("create_key", "--team", "search", stdout=io.StringIO(), stderr=io.StringIO())
    event = only("api_key.create")
    assert (event.actor, event.actor_repr, event.ip) == (None, "system", None)


def test_registering_a_node_and_its_gpus_through_the_api_is_recorded(alice):
    client = api_client(alice)
    assert client.post("/api/v1/nodes/", {"name": "dgx-v100-02"}, format="json").status_code == 201
    event = only("node.create")
    assert (event.actor, event.target_repr, event.changes["name"]) == (alice, "dgx-v100-02", "dgx-v100-02")
    body = {"query_csv": nvidia_smi_sample("v100_sxm2_8x_query.csv"),
            "topology": nvidia_smi_sample("v100_sxm2_8x_topo.txt")}  # fmt: skip
    assert client.post("/api/v1/nodes/dgx-v100-02/nvidia-smi/", body, format="json").status_code == 200
    assert only("node.apply_nvidia_smi").changes == {"gpus": 8}
    assert (
        client.patch("/api/v1/nodes/dgx-v100-02/", {"description": "rack 4"}, format="json").status_code
        == 200
    )
    assert only("node.update").changes == {"description": ["", "rack 4"]}
    assert client.delete("/api/v1/nodes/dgx-v100-02/").status_code == 204
    assert only("node.delete").target_repr == "dgx-v100-02"


def test_registering_a_model_version_through_the_api_is_recorded(alice):
    body = {"name": "llama-2-13b", "config": bundled_config("llama-2-7b-chat-hf")}
    assert api_client(alice).post("/api/v1/model-versions/", body, format="json").status_code == 201
    event = only("modelversion.create")
    assert (event.actor, event.target_repr) == (alice, "llama-2-13b")


def test_creating_and_deleting_a_deployment_through_the_api_is_recorded(
    alice, team, llama7b, profile_tp8, dgx
):
    client = api_client(alice)
    body = {"name": "new-llama", "team": "search", "model_version": llama7b.name, "profile": profile_tp8.name,
            "node": dgx.name, "gpu_indices": list(range(8)), "desired_state": "stopped"}  # fmt: skip
    assert client.post("/api/v1/deployments/", body, format="json").status_code == 201
    assert only("deployment.create").changes["team"] == "search"
    assert client.delete("/api/v1/deployments/new-llama/").status_code == 204
    assert only("deployment.delete").target_repr == "new-llama"


def test_registering_an_endpoint_is_recorded(alice, team, llama7b):
    body = {"name": "adopted", "team": "search", "model_version": llama7b.name, "url": "http://127.0.0.1:9/v1",
            "shared": True}  # fmt: skip
    assert (
        api_client(alice).post("/api/v1/deployments/register-endpoint/", body, format="json").status_code
        == 201
    )
    assert only("deployment.register_endpoint").changes == {
        "team": "search", "endpoint_url": "http://127.0.0.1:9", "shared": True, "with_api_key": False,
    }  # fmt: skip


def test_a_team_quota_change_through_the_api_is_recorded_with_the_values(alice, team):
    response = api_client(alice).patch("/api/v1/teams/search/", {"gpu_quota": 16}, format="json")
    assert response.status_code == 200
    assert only("team.quotas_change").changes == {"gpu_quota": [8, 16]}
    assert only("team.update").changes == {"gpu_quota": [8, 16]}


# --- the Django admin -------------------------------------------------------------------------


def test_admin_add_change_and_delete_are_recorded(admin_user):
    client = logged_in(admin_user)
    # allowed_models is a multi-select: nothing picked is sent as no value at all.
    form = {"name": "Ads", "slug": "ads", "gpu_quota": 4, "max_tokens_clamp": 1024,
            "priority_class": "interactive"}  # fmt: skip
    assert client.post("/admin/teams/team/add/", form).status_code == 302
    ads = Team.objects.get(slug="ads")
    added = only("admin.add")
    assert (added.actor, added.target_type, added.target_id, added.target_repr) == (
        admin_user, "teams.team", str(ads.pk), "Ads",
    )  # fmt: skip
    assert not AuditEvent.objects.filter(action="team.quotas_change").exists()  # a new team has no "before"

    form.update(gpu_quota=6, rpm_limit=600)
    assert client.post(f"/admin/teams/team/{ads.pk}/change/", form).status_code == 302
    assert "Changed" in only("admin.change").changes["message"]
    assert only("team.quotas_change").changes == {"gpu_quota": [4, 6], "rpm_limit": [None, 600]}

    assert client.post(f"/admin/teams/team/{ads.pk}/delete/", {"post": "yes"}).status_code == 302
    deleted = only("admin.delete")
    assert (deleted.target_id, deleted.target_repr, deleted.ip) == (str(ads.pk), "Ads", "127.0.0.1")


def test_an_admin_action_on_deployments_is_recorded(admin_user, deployment):
    response = logged_in(admin_user).post(
        "/admin/deployments/deployment/",
        {"action": "start_selected", "_selected_action": [deployment.pk]},
    )
    assert response.status_code == 302
    assert only("deployment.start").actor == admin_user


# --- append-only ---------------------------------------------------------------------------------


def test_the_log_cannot_be_changed_or_deleted(alice, team):
    api_key_create(team=team)
    event = AuditEvent.objects.get()
    event.action = "forged"
    with pytest.raises(AppendOnlyError):
        event.save()
    with pytest.raises(AppendOnlyError):
        event.delete()
    with pytest.raises(AppendOnlyError):
        AuditEvent.objects.update(action="forged")
    with pytest.raises(AppendOnlyError):
        AuditEvent.objects.all().delete()
    assert AuditEvent.objects.get().action == "api_key.create"


def test_the_admin_lists_the_log_but_cannot_add_change_or_delete(admin_user, team):
    api_key_create(team=team)
    event = AuditEvent.objects.get()
    client = logged_in(admin_user)
    listing = client.get("/admin/audit/auditevent/")
    assert listing.status_code == 200 and "api_key.create" in listing.content.decode()
    assert client.get("/admin/audit/auditevent/add/").status_code == 403
    assert client.post(f"/admin/audit/auditevent/{event.pk}/delete/", {"post": "yes"}).status_code == 403
    detail = client.get(f"/admin/audit/auditevent/{event.pk}/change/")
    assert detail.status_code == 200 and 'name="action"' not in detail.content.decode()  # read-only view
    assert AuditEvent.objects.count() == 1


def test_deleting_the_actor_keeps_who_it_was(bob, team, django_user_model):
    logged_in(bob).post("/teams/search/keys/", {"name": "ci"})
    bob.delete()
    event = only("api_key.create")
    assert (event.actor, event.actor_repr) == (None, "bob")


def test_the_admin_list_has_readable_headers_and_a_whole_address(admin_user):
    AuditEvent.objects.create(
        action="node.create", actor=admin_user, actor_repr="root", ip="2001:db8:85a3::8a2e:370:7334"
    )
    page = logged_in(admin_user).get("/admin/audit/auditevent/").content.decode()
    assert "Actor repr" not in page and "Target repr" not in page
    assert "client address" in page.lower()
    address = "2001:db8:85a3::8a2e:370:7334"
    assert f'<span class="audit-address" style="white-space: nowrap">{address}</span>' in page
