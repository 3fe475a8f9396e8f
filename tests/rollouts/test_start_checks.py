"""What a rollout checks at its start (issue 26): the new version has release hashes, the planner
accepts it on the GPUs it will run on, and those GPUs are free; where the old version holds them,
the refusal offers the ways to free them (API body and page form) and a chosen one is carried out."""

from __future__ import annotations

import uuid

import pytest

from tests.helpers.rollouts import deployment_of, shares_of


def _start(served, new, old, **kw):
    from portal.rollouts.services import rollout_start

    return rollout_start(
        served_model=served, to_deployment=new, from_deployment=old, steps=[[50, 1], [100, 1]], **kw
    )


def _served(old):
    from portal.registry.services import served_model_create

    return served_model_create(name=f"chat-{uuid.uuid4().hex[:6]}", shares={old.model_version.name: 10_000})


@pytest.fixture
def on_dgx(db, team, dgx):
    """The old version on GPU 0 of the DGX (one replica), a stopped new deployment wanting GPU 0."""
    team.gpu_quota = 8
    team.save()
    tag = uuid.uuid4().hex[:6]
    old = deployment_of(team=team, node=dgx, name=f"v1-{tag}", gpu_indices=[0])
    new = deployment_of(
        team=team, node=dgx, name=f"v2-{tag}", gpu_indices=[0], state="stopped", desired_state="stopped"
    )
    return old, new, _served(old)


def test_it_refuses_a_version_without_release_hashes(pair):
    from portal.core.errors import ApplicationError
    from portal.registry.models import ModelVersion

    ModelVersion.objects.filter(pk=pair.new.model_version_id).update(weights_sha256="", tokenizer_sha256="")
    pair.new.refresh_from_db()
    with pytest.raises(ApplicationError, match="no release hashes") as refused:
        _start(pair.served, pair.new, pair.old)
    assert refused.value.field == "to_deployment"
    assert not pair.served.rollouts.exists()


def test_it_refuses_what_the_planner_refuses_on_its_gpus(db, team, dgx, on_dgx):
    from portal.core.errors import ApplicationError

    old, _, served = on_dgx
    # A 70B model on one 32 GB V100: the planner says it does not fit.
    too_big = deployment_of(
        team=team, node=dgx, name=f"big-{uuid.uuid4().hex[:6]}", config="llama-3.1-70b-instruct-gptq-4bit",
        gpu_indices=[3], state="stopped", desired_state="stopped",
    )  # fmt: skip
    with pytest.raises(ApplicationError, match="the planner refuses") as refused:
        _start(served, too_big, old)
    assert refused.value.extra["findings"]
    assert not served.rollouts.exists()


def test_on_free_gpus_it_starts_the_new_deployment(db, team, dgx, on_dgx):
    from portal.deployments.models import Deployment

    old, new, served = on_dgx
    Deployment.objects.filter(pk=new.pk).update(gpu_indices=[1])
    new.refresh_from_db()
    rollout = _start(served, new, old)
    new.refresh_from_db()
    assert rollout.state == "warming" and new.desired_state == "running"
    assert rollout.freed_deployment is None


def test_with_no_free_gpu_it_offers_an_in_place_swap_with_its_downtime(on_dgx, alice, settings):
    from portal.deployments.models import DeploymentEvent
    from tests.helpers.clients import api_client

    old, new, served = on_dgx
    settings.DEPLOYMENT_DRAIN_TIMEOUT_S = 30
    DeploymentEvent.objects.create(deployment=new, step="serving", status="ok", seconds=95.0)
    response = api_client(alice).post(
        "/api/v1/rollouts/",
        {"served_model": served.name, "to_deployment": new.name, "from_deployment": old.name},
        format="json",
    )
    assert response.status_code == 400, response.content
    body = response.json()
    assert body["no_free_gpus"] is True
    assert "No free GPUs" in body["gpu_choice"][0] and f"GPU 0 ({old.name})" in body["gpu_choice"][0]
    [choice] = body["choices"]
    assert choice["choice"] == "in_place" and choice["deployment"] == old.name
    assert choice["downtime_s"] == 125  # drain (30 s) + its last start (95 s), said up front
    assert "serves nothing about 125 s" in choice["message"]
    assert not served.rollouts.exists()

    # Chosen: the old deployment is stopped, the new one started on its GPUs; a roll-back undoes it.
    response = api_client(alice).post(
        "/api/v1/rollouts/",
        {"served_model": served.name, "to_deployment": new.name, "from_deployment": old.name,
         "gpu_choice": "in_place"},
        format="json",
    )  # fmt: skip
    assert response.status_code == 201, response.content
    assert response.json()["freed_deployment"] == old.name and response.json()["downtime_s"] == 125
    old.refresh_from_db()
    new.refresh_from_db()
    assert old.desired_state == "stopped" and new.desired_state == "running"
    rollout = served.rollouts.get()
    assert [e.kind for e in rollout.events.all()] == ["free_gpus", "start"]

    from django.utils import timezone

    from portal.rollouts.services import rollout_rollback, rollouts_stop_due

    rollout_rollback(rollout=rollout, actor=alice)
    rollouts_stop_due(now=timezone.now() + timezone.timedelta(seconds=settings.GATEWAY_CACHE_S + 2))
    old.refresh_from_db()
    new.refresh_from_db()
    assert new.desired_state == "stopped" and old.desired_state == "running"  # the old one back
    assert shares_of(served)[old.model_version.name] == 10_000


def test_with_several_replicas_it_offers_to_take_one_out_of_the_pool(on_dgx, team, dgx, alice, client):
    from portal.deployments.models import Deployment

    old, new, served = on_dgx
    Deployment.objects.create(
        name=f"r2-{uuid.uuid4().hex[:6]}", team=team, model_version=old.model_version, profile=old.profile,
        node=dgx, gpu_indices=[1], desired_state="running", state="serving", endpoint_url="http://127.0.0.1:9",
    )  # fmt: skip
    client.force_login(alice)
    form = {"served_model": served.name, "to_deployment": new.name, "from_deployment": old.name,
            "steps": "50x1, 100x1"}  # fmt: skip
    page = client.post("/rollouts/new/", form).content.decode()
    assert "No free GPUs" in page and 'id="gpu-choices"' in page
    assert "take_replica" in page and "keeps 1 of its 2 replicas" in page
    assert not served.rollouts.exists()

    response = client.post("/rollouts/new/", {**form, "gpu_choice": "take_replica"})
    assert response.status_code == 302
    rollout = served.rollouts.get()
    old.refresh_from_db()
    assert rollout.freed_deployment == old and rollout.downtime_s is None
    assert old.desired_state == "stopped"


def test_a_freed_deployment_whose_gpus_were_taken_meanwhile_is_reported_not_restarted(
    on_dgx, team, dgx, alice
):
    from django.utils import timezone

    from portal.rollouts.services import rollout_rollback, rollouts_stop_due

    old, new, served = on_dgx
    rollout = _start(served, new, old, gpu_choice="in_place")
    rollout_rollback(rollout=rollout, actor=alice)
    # Between the roll-back and the stop, ops gave GPU 0 to something else.
    new.refresh_from_db()
    other = deployment_of(team=team, node=dgx, name=f"other-{uuid.uuid4().hex[:6]}", gpu_indices=[0])
    assert other.desired_state == "running"
    later = timezone.now() + timezone.timedelta(seconds=120)
    assert rollouts_stop_due(now=later) == [rollout.pk]  # handled once, not retried forever
    old.refresh_from_db()
    assert old.desired_state == "stopped"
    restart = rollout.events.get(kind="restart")
    assert "could not be started again" in restart.message and other.name in restart.message


def test_its_refusal_names_the_missing_tokenizer_and_the_real_button(pair):
    from portal.core.errors import ApplicationError
    from portal.registry.models import ModelVersion

    ModelVersion.objects.filter(pk=pair.new.model_version_id).update(tokenizer_sha256="")
    pair.new.refresh_from_db()
    with pytest.raises(ApplicationError) as refused:
        _start(pair.served, pair.new, pair.old)
    assert "has no release hashes for its tokenizer:" in refused.value.message
    assert "the Hash files button on its model version page" in refused.value.message


def test_a_simulator_only_version_rolls_out_on_a_simulated_node_and_nowhere_else(pair, alice, client):
    from portal.core.errors import ApplicationError
    from portal.deployments.models import DeploymentProfile
    from portal.registry.models import ModelVersion

    version = pair.new.model_version
    ModelVersion.objects.filter(pk=version.pk).update(weights_sha256="", tokenizer_sha256="")
    client.force_login(alice)
    page = client.get(version.get_absolute_url()).content.decode()
    assert "Mark release-checked for simulated nodes only" in page
    client.post(f"/models/{version.name}/simulated-release/")
    version.refresh_from_db()
    assert version.simulated_release_at is not None
    assert (
        "Release-checked for <strong>simulated nodes only</strong>"
        in client.get(version.get_absolute_url()).content.decode()
    )

    pair.new.refresh_from_db()
    with pytest.raises(ApplicationError, match=r"release-checked for simulated nodes only; .* real engine"):
        _start(pair.served, pair.new, pair.old)
    DeploymentProfile.objects.filter(pk=pair.new.profile_id).update(engine="sim")
    pair.new.refresh_from_db()
    assert _start(pair.served, pair.new, pair.old).state == "warming"
