"""The rollouts REST API: staff drive a rollout; members read the rollouts of the served names their
team may call, and anyone else's is a 404 (the isolation contract)."""

from __future__ import annotations

from tests.helpers.clients import api_client
from tests.helpers.rollouts import on_eight_gpus, shares_of

URL = "/api/v1/rollouts/"


def test_staff_start_pause_resume_and_roll_back_a_rollout(pair, alice):
    client = api_client(alice)
    started = client.post(
        URL,
        {
            "served_model": pair.served.name,
            "to_deployment": pair.new.name,
            "from_deployment": pair.old.name,
            "steps": [[10, 5], [100, 5]],
        },
        format="json",
    )
    assert started.status_code == 201, started.content
    body = started.json()
    assert body["state"] == "warming"
    assert body["shares_percent"] == {pair.old.model_version.name: 100.0, pair.new.model_version.name: 0.0}
    assert body["steps"] == [{"share_percent": 10, "minutes": 5}, {"share_percent": 100, "minutes": 5}]
    rollout_url = f"{URL}{body['id']}/"

    assert client.post(f"{rollout_url}pause/").json()["state"] == "paused"
    again = client.post(f"{rollout_url}pause/")
    assert again.status_code == 400 and "cannot be paused" in again.json()["state"][0]
    assert client.post(f"{rollout_url}resume/").json()["state"] == "warming"
    rolled = client.post(f"{rollout_url}rollback/", {"reason": "wrong adapter"}, format="json").json()
    assert rolled["state"] == "rolled_back"
    assert [e["kind"] for e in rolled["events"]] == ["start", "pause", "resume", "roll_back"]
    assert rolled["events"][-1]["actor_repr"] == "alice"
    assert shares_of(pair.served)[pair.new.model_version.name] == 0


def test_it_refuses_bad_steps_with_a_message_naming_the_field(pair, alice):
    response = api_client(alice).post(
        URL,
        {
            "served_model": pair.served.name,
            "to_deployment": pair.new.name,
            "steps": [[10, 5], [100, 100_000]],
        },
        format="json",
    )
    assert response.status_code == 400
    assert "1 to 1440 minutes" in response.json()["steps"][0]


def test_members_read_but_never_write(pair, alice, bob, team):
    from portal.rollouts.services import rollout_start

    rollout = rollout_start(served_model=pair.served, to_deployment=pair.new, actor=alice)
    member = api_client(bob)  # bob is in team "search", which may call every name
    assert member.get(f"{URL}{rollout.pk}/").json()["state"] == "warming"
    assert [r["id"] for r in member.get(URL).json()["results"]] == [rollout.pk]
    for verb in ("pause", "resume", "promote", "rollback"):
        assert member.post(f"{URL}{rollout.pk}/{verb}/").status_code == 403
    refused = member.post(
        URL, {"served_model": pair.served.name, "to_deployment": pair.new.name}, format="json"
    )
    assert refused.status_code == 403


def test_a_rollout_of_a_name_the_team_may_not_call_is_a_404(pair, alice, charlie, bob, team):
    from portal.rollouts.services import rollout_start
    from portal.teams.models import Team

    rollout = rollout_start(served_model=pair.served, to_deployment=pair.new, actor=alice)
    other = Team.objects.create(name="Ads", slug="ads", allowed_models=["chat-elsewhere"])
    other.members.add(charlie)
    outsider = api_client(charlie)
    assert outsider.get(f"{URL}{rollout.pk}/").status_code == 404
    assert outsider.get(URL).json()["results"] == []
    # Allowed the served name, but none of the rollout's deployments is the team's: still nothing.
    other.allowed_models = [pair.served.name]
    other.save()
    assert outsider.get(f"{URL}{rollout.pk}/").status_code == 404
    # Nobody signed in: nothing at all.
    assert api_client().get(URL).status_code in (401, 403)


def test_staff_create_a_served_name_and_set_its_shares_in_percent(pair, alice, bob):
    old, new = pair.old.model_version.name, pair.new.model_version.name
    staff = api_client(alice)
    created = staff.post(
        "/api/v1/served-models/", {"name": "chat-api", "shares": {old: 99.5, new: 0.5}}, format="json"
    )
    assert created.status_code == 201, created.content
    assert created.json()["shares_percent"] == {old: 99.5, new: 0.5}
    wrong = staff.post(
        "/api/v1/served-models/chat-api/shares/", {"shares": {old: 70, new: 20}}, format="json"
    )
    assert wrong.status_code == 400 and "add up to 90 %" in wrong.json()["versions"][0]
    moved = staff.post(
        "/api/v1/served-models/chat-api/shares/", {"shares": {old: 30, new: 70}}, format="json"
    )
    assert moved.json()["shares_percent"] == {old: 30.0, new: 70.0}
    member = api_client(bob)
    assert member.get("/api/v1/served-models/chat-api/").status_code == 200
    assert (
        member.post(
            "/api/v1/served-models/chat-api/shares/", {"shares": {old: 100}}, format="json"
        ).status_code
        == 403
    )


def test_staff_turn_a_versions_own_name_off(pair, alice):
    name = pair.new.model_version.name
    response = api_client(alice).patch(
        f"/api/v1/model-versions/{name}/", {"callable_by_name": False}, format="json"
    )
    assert response.status_code == 200, response.content
    pair.new.model_version.refresh_from_db()
    assert pair.new.model_version.callable_by_name is False


def test_staff_register_a_version_callable_only_through_served_names(alice):
    from portal.registry.models import ModelVersion
    from tests.helpers.samples import bundled_config

    response = api_client(alice).post(
        "/api/v1/model-versions/",
        {"name": "chat-v9", "config": bundled_config("llama-2-7b-chat-hf"), "callable_by_name": False},
        format="json",
    )
    assert response.status_code == 201, response.content
    assert ModelVersion.objects.get(name="chat-v9").callable_by_name is False


def test_another_teams_member_without_an_allowed_list_gets_a_404_on_its_rollout(pair, alice, charlie):
    from portal.rollouts.services import rollout_start
    from portal.teams.models import Team

    rollout = rollout_start(served_model=pair.served, to_deployment=pair.new, actor=alice)
    Team.objects.create(name="Ads", slug="ads").members.add(charlie)  # may call every name
    outsider = api_client(charlie)
    assert outsider.get(f"{URL}{rollout.pk}/").status_code == 404
    assert outsider.get(URL).json()["results"] == []


def test_another_teams_member_without_an_allowed_list_gets_a_404_on_its_served_name(pair, charlie):
    from portal.teams.models import Team

    Team.objects.create(name="Ads", slug="ads").members.add(charlie)
    outsider = api_client(charlie)
    assert outsider.get(f"/api/v1/served-models/{pair.served.name}/").status_code == 404
    assert outsider.get("/api/v1/served-models/").json()["results"] == []


def test_a_member_reads_no_name_of_another_teams_deployment_in_a_rollout(pair, alice, bob):
    from portal.rollouts.services import rollout_start
    from portal.teams.models import Team
    from tests.helpers.builders import serving_deployment

    ads = Team.objects.create(name="Ads", slug="ads")
    private = serving_deployment(
        name="ads-chat", team=ads, model_version=pair.old.model_version, endpoint_url="http://127.0.0.1:9"
    )
    rollout = rollout_start(
        served_model=pair.served, to_deployment=pair.new, from_deployment=private, actor=alice
    )
    data = api_client(bob).get(f"{URL}{rollout.pk}/").json()
    assert data["to_deployment"] == pair.new.name
    assert data["from_deployment"] is None


def test_a_start_on_other_hardware_warns_and_may_compare_against_the_sla_only(pair, alice):
    on_eight_gpus(pair.old)
    body = api_client(alice).post(
        URL,
        {"served_model": pair.served.name, "to_deployment": pair.new.name,
         "from_deployment": pair.old.name, "compare_sla_only": True},
        format="json",
    ).json()  # fmt: skip
    assert body["compare_sla_only"] is True
    assert len(body["warnings"]) == 1
    assert (
        "GPU count, tensor-parallel size: 1 × unknown GPU, TP 1 against 8 × unknown GPU, TP 8"
        in (body["warnings"][0])
    )
    assert [e["kind"] for e in body["events"]] == ["start", "warning"]
    assert "judged against the SLA only" in body["events"][0]["message"]


def test_a_start_on_the_same_hardware_warns_of_nothing(pair, alice):
    body = (
        api_client(alice)
        .post(URL, {"served_model": pair.served.name, "to_deployment": pair.new.name}, format="json")
        .json()
    )
    assert body["warnings"] == [] and body["compare_sla_only"] is False


def test_it_filters_rollouts_by_state_and_refuses_an_unknown_one(pair, alice, charlie):
    client = api_client(alice)
    body = {"served_model": pair.served.name, "to_deployment": pair.new.name, "steps": [[100, 5]]}
    started = client.post(URL, {**body, "from_deployment": pair.old.name}, format="json").json()
    client.post(f"{URL}{started['id']}/pause/")
    assert [r["id"] for r in client.get(URL, {"state": "paused"}).json()["results"]] == [started["id"]]
    assert client.get(URL, {"state": "warming"}).json()["results"] == []
    assert client.get(URL, {"served_model": pair.served.name}).json()["count"] == 1
    assert client.get(URL, {"state": "exploded"}).status_code == 400
    # charlie (no team) finds nothing through a filter that names it exactly
    assert api_client(charlie).get(URL, {"served_model": pair.served.name}).json()["results"] == []
