"""The rollout page and the deployment page's line about a rollout in progress."""

from __future__ import annotations

import datetime as dt

from django.utils import timezone

from tests.helpers.rollouts import measured, on_eight_gpus


def test_the_rollout_page_shows_steps_shares_measurements_and_buttons(pair, alice, client):
    from portal.rollouts.services import rollout_evaluate, rollout_start

    rollout = rollout_start(
        served_model=pair.served, to_deployment=pair.new, from_deployment=pair.old, steps=[[10, 5], [100, 5]]
    )
    t0 = timezone.now()
    rollout_evaluate(rollout=rollout, now=t0 - dt.timedelta(seconds=1))
    measured(pair.new, t0, requests=12, errors=1, ttft_ms=812)
    measured(pair.old, t0, requests=108, ttft_ms=640)
    client.force_login(alice)
    page = client.get(f"/rollouts/{rollout.pk}/").content.decode()
    assert "10.00 %" in page and "90.00 %" in page  # the live shares
    assert "812 ms" in page and "640 ms" in page  # both versions this step
    assert "SLA 3000 ms" in page
    assert "Roll back" in page and "Pause" in page

    response = client.post(f"/rollouts/{rollout.pk}/pause/")
    assert response.status_code == 302
    rollout.refresh_from_db()
    assert rollout.state == "paused"

    deployment_page = client.get(pair.new.get_absolute_url()).content.decode()
    assert "Rollout in progress" in deployment_page and f"/rollouts/{rollout.pk}/" in deployment_page


def test_members_see_no_buttons_and_cannot_post(pair, alice, bob, client):
    from portal.rollouts.services import rollout_start

    rollout = rollout_start(served_model=pair.served, to_deployment=pair.new, actor=alice)
    client.force_login(bob)
    page = client.get(f"/rollouts/{rollout.pk}/").content.decode()
    assert "Roll back" not in page
    assert client.post(f"/rollouts/{rollout.pk}/rollback/").status_code == 403
    rollout.refresh_from_db()
    assert rollout.state == "warming"


def test_another_teams_member_gets_a_404(pair, alice, charlie, client):
    from portal.rollouts.services import rollout_start
    from portal.teams.models import Team

    rollout = rollout_start(served_model=pair.served, to_deployment=pair.new, actor=alice)
    Team.objects.create(name="Ads", slug="ads", allowed_models=["else"]).members.add(charlie)
    client.force_login(charlie)
    assert client.get(f"/rollouts/{rollout.pk}/").status_code == 404
    assert client.post(f"/rollouts/{rollout.pk}/rollback/").status_code == 404


def test_the_team_usage_page_reads_a_served_name_per_version(pair, team, bob, client):
    from portal.teams.models import Usage
    from portal.teams.services import api_key_create

    key, _ = api_key_create(team=team, name="k")
    for deployment, status, n in (
        (pair.old, "completed", 3),
        (pair.new, "completed", 2),
        (pair.new, "upstream_error", 1),
    ):
        for _ in range(n):
            Usage.objects.create(
                team=team, api_key=key, model=pair.served.name, deployment=deployment, status=status,
                http_status=200 if status == "completed" else 502, created_at=timezone.now(),
                prompt_tokens=10, completion_tokens=5, duration_ms=10.0,
            )  # fmt: skip
    from portal.teams.selectors import usage_today_by_version

    rows = {(r["version"], r["requests"], r["errors"]) for r in usage_today_by_version(team)}
    assert rows == {(pair.old.model_version.name, 3, 0), (pair.new.model_version.name, 3, 1)}
    client.force_login(bob)
    page = client.get(f"/teams/{team.slug}/usage/").content.decode()
    assert "Today by model and version" in page and pair.new.model_version.name in page


def test_staff_start_a_rollout_from_the_page_and_see_it_listed(pair, alice, client):
    from portal.rollouts.models import Rollout

    client.force_login(alice)
    assert "Start" in client.get("/rollouts/new/").content.decode()
    bad = client.post(
        "/rollouts/new/",
        {"served_model": pair.served.name, "to_deployment": pair.new.name, "steps": "10x5, 50x5"},
    )
    assert "last step must send 100" in bad.content.decode()
    response = client.post(
        "/rollouts/new/",
        {"served_model": pair.served.name, "to_deployment": pair.new.name, "from_deployment": pair.old.name,
         "steps": "10% x 5, 100x5 min"},
    )  # fmt: skip
    rollout = Rollout.objects.get()
    assert response.status_code == 302 and response["Location"] == f"/rollouts/{rollout.pk}/"
    assert rollout.steps == [{"share_percent": 10, "minutes": 5}, {"share_percent": 100, "minutes": 5}]
    assert pair.served.name in client.get("/rollouts/").content.decode()


def test_members_cannot_open_the_start_form(bob, client):
    client.force_login(bob)
    assert client.get("/rollouts/new/").status_code == 403
    assert client.get("/rollouts/").status_code == 200


def test_the_served_model_pages_list_names_versions_live_shares_and_the_rollout(pair, alice, bob, client):
    from portal.rollouts.services import rollout_start, rollouts_advance_all

    rollout = rollout_start(
        served_model=pair.served, to_deployment=pair.new, from_deployment=pair.old, steps=[[10, 5], [100, 5]]
    )
    rollouts_advance_all()  # the new deployment serves: 10 % to it
    client.force_login(alice)
    listing = client.get("/rollouts/served-models/").content.decode()
    assert pair.served.name in listing and "10.00 %" in listing and "90.00 %" in listing
    assert f"/rollouts/{rollout.pk}/" in listing and "step 1 of 2" in listing
    page = client.get(f"/rollouts/served-models/{pair.served.name}/").content.decode()
    assert "Rollout in progress" in page and f"/rollouts/{rollout.pk}/" in page
    for deployment in (pair.old, pair.new):
        assert deployment.model_version.name in page and deployment.name in page  # each version's replica
    assert "10.00 %" in page and "90.00 %" in page

    # A member whose team may not call the name sees neither page of it.
    from portal.teams.models import Team

    Team.objects.filter(members=bob).update(allowed_models=["something-else"])
    client.force_login(bob)
    assert pair.served.name not in client.get("/rollouts/served-models/").content.decode()
    assert client.get(f"/rollouts/served-models/{pair.served.name}/").status_code == 404


def test_another_teams_member_without_an_allowed_list_gets_a_404_on_the_rollout_page(
    pair, alice, charlie, client
):
    from portal.rollouts.services import rollout_start
    from portal.teams.models import Team

    rollout = rollout_start(served_model=pair.served, to_deployment=pair.new, actor=alice)
    Team.objects.create(name="Ads", slug="ads").members.add(charlie)  # may call every name
    client.force_login(charlie)
    assert client.get(f"/rollouts/{rollout.pk}/").status_code == 404
    assert pair.served.name not in client.get("/rollouts/").content.decode()


def test_another_teams_member_without_an_allowed_list_gets_a_404_on_the_served_name_page(
    pair, charlie, client
):
    from portal.teams.models import Team

    Team.objects.create(name="Ads", slug="ads").members.add(charlie)
    client.force_login(charlie)
    assert client.get(f"/rollouts/served-models/{pair.served.name}/").status_code == 404
    assert pair.served.name not in client.get("/rollouts/served-models/").content.decode()


def test_a_served_name_page_lists_only_the_members_own_replicas(pair, bob, client):
    from portal.teams.models import Team
    from tests.helpers.builders import serving_deployment

    ads = Team.objects.create(name="Ads", slug="ads")
    serving_deployment(
        name="ads-private-chat",
        team=ads,
        model_version=pair.old.model_version,
        endpoint_url="http://127.0.0.1:9",
    )
    client.force_login(bob)
    page = client.get(f"/rollouts/served-models/{pair.served.name}/").content.decode()
    assert pair.old.name in page
    assert "ads-private-chat" not in page


def test_the_rollout_page_tells_the_last_judgement_in_words(pair, alice, client):
    from portal.rollouts.services import rollout_evaluate, rollout_start

    rollout = rollout_start(
        served_model=pair.served, to_deployment=pair.new, from_deployment=pair.old, steps=[[10, 5], [100, 5]]
    )
    t0 = timezone.now()
    rollout_evaluate(rollout=rollout, now=t0 - dt.timedelta(seconds=1))
    measured(pair.new, t0, requests=38, errors=38)
    measured(pair.old, t0, requests=146, errors=146)
    rollout_evaluate(rollout=rollout, now=t0 + dt.timedelta(seconds=20))
    client.force_login(alice)
    page = client.get(f"/rollouts/{rollout.pk}/").content.decode()
    assert "Last evaluation: Step 1 after 21 s: pause — both versions failing pauses the rollout" in page
    assert "New: 38 requests, 38 errors (100.0%)" in page
    assert "{&#x27;" not in page and "{'" not in page  # no raw dict


def test_the_start_form_warns_of_other_hardware_and_offers_the_sla_only(pair, alice, client):
    from portal.rollouts.models import Rollout

    on_eight_gpus(pair.old)
    client.force_login(alice)
    form = client.get("/rollouts/new/").content.decode()
    assert "Compare against the SLA only" in form
    response = client.post(
        "/rollouts/new/",
        {"served_model": pair.served.name, "to_deployment": pair.new.name, "from_deployment": pair.old.name,
         "steps": "10x5, 100x5", "compare_sla_only": "on"},
        follow=True,
    )  # fmt: skip
    page = response.content.decode()
    assert "runs on other hardware than" in page
    assert "judged against the SLA only, not the old version" in page
    assert Rollout.objects.get(served_model=pair.served).compare_sla_only is True


def test_staff_create_a_served_name_and_change_its_shares_from_the_pages(pair, alice, client):
    from portal.registry.models import ServedModel

    old, new = pair.old.model_version.name, pair.new.model_version.name
    client.force_login(alice)
    assert "New served name" in client.get("/rollouts/served-models/").content.decode()
    created = client.post(
        "/rollouts/served-models/new/", {"name": "assistant", "shares": f"{old}=100"}, follow=True
    )
    assert created.redirect_chain[-1][0] == "/rollouts/served-models/assistant/"
    page = created.content.decode()
    assert old in page and "100.00 %" in page and "Set shares" in page

    client.post("/rollouts/served-models/assistant/shares/", {"shares": f"{old}=90, {new}=10"})
    served = ServedModel.objects.get(name="assistant")
    assert dict(served.versions.values_list("model_version__name", "share_bp")) == {old: 9_000, new: 1_000}
    page = client.get("/rollouts/served-models/assistant/").content.decode()
    assert "90.00 %" in page and "10.00 %" in page

    refused = client.post(
        "/rollouts/served-models/assistant/shares/", {"shares": f"{old}=90, {new}=20"}, follow=True
    ).content.decode()
    assert "Shares not set" in refused
    bad = client.post("/rollouts/served-models/new/", {"name": "x", "shares": f"{old}=abc"}).content.decode()
    assert "is not version=percent" in bad


def test_members_get_no_served_name_forms_and_cannot_post_them(pair, bob, client):
    client.force_login(bob)
    assert "New served name" not in client.get("/rollouts/served-models/").content.decode()
    assert client.post("/rollouts/served-models/new/", {"name": "x", "shares": "a=100"}).status_code == 403
    response = client.post(f"/rollouts/served-models/{pair.served.name}/shares/", {"shares": "a=100"})
    assert response.status_code == 403


def test_members_see_the_served_names_they_may_call_on_their_front_page_and_key_form(pair, team, bob, client):
    from portal.registry.models import ModelVersion

    old_version = pair.old.model_version.name
    ModelVersion.objects.filter(name=old_version).update(callable_by_name=False)  # only via the served name
    client.force_login(bob)
    home = client.get("/").content.decode()
    assert f"<code>{pair.served.name}</code>" in home
    assert f"<code>{old_version}</code>" not in home
    keys = client.get(f"/teams/{team.slug}/keys/").content.decode()
    assert f"served names {pair.served.name}" in keys


def test_the_start_form_offers_no_acceptance_reference_deployment(pair, alice, client, team, dgx):
    from portal.inventory.models import ACCEPTANCE_SOURCE_PREFIX
    from tests.helpers import builders

    version = builders.model_version("accept-tiny-fp16", source=f"{ACCEPTANCE_SOURCE_PREFIX} (tiny)")
    profile = builders.profile(version, name="accept-dgx-v100-01-1")
    builders.deployment(
        name="accept-dgx-v100-01-1", team=team, model_version=version, profile=profile, node=dgx
    )
    client.force_login(alice)
    form = client.get("/rollouts/new/").context["form"]
    for field in ("to_deployment", "from_deployment"):
        assert "accept-dgx-v100-01-1" not in [d.name for d in form.fields[field].queryset]
