"""The rollout state machine (issue 26) on real rows: warm-up, steps judged on synthetic latency
rollups, automatic roll-back on a breach, pause and resume, promotion, and claims that a second
worker cannot repeat."""

from __future__ import annotations

import datetime as dt
import threading

import pytest
from django.db import connection
from django.utils import timezone

from tests.helpers.rollouts import make_pair, measured, shares_of

TWO_STEPS = [[10, 1], [100, 1]]


def _start(pair, steps=TWO_STEPS, **kw):
    from portal.rollouts.services import rollout_start

    return rollout_start(
        served_model=pair.served, to_deployment=pair.new, from_deployment=pair.old, steps=steps, **kw
    )


def _kinds(rollout) -> list[str]:
    return list(rollout.events.values_list("kind", flat=True))


def test_it_starts_with_the_new_version_at_zero_and_records_it(pair, alice):
    from portal.audit.models import AuditEvent

    rollout = _start(pair, steps=None, actor=alice)
    assert rollout.state == "warming"
    assert [s["share_percent"] for s in rollout.steps] == [5, 25, 50, 100]  # the defaults
    assert shares_of(pair.served) == {pair.old.model_version.name: 10_000, pair.new.model_version.name: 0}
    assert _kinds(rollout) == ["start"]
    assert AuditEvent.objects.filter(action="rollout.start", actor=alice, target_id=str(rollout.pk)).exists()


def test_it_refuses_a_second_rollout_and_bad_steps(pair, team, cpu_node):
    from portal.core.errors import ApplicationError
    from portal.rollouts.services import rollout_start
    from tests.helpers.rollouts import deployment_of

    with pytest.raises(ApplicationError, match="last step must send 100"):
        _start(pair, steps=[[10, 1], [50, 1]])
    with pytest.raises(ApplicationError, match="larger than the one before"):
        _start(pair, steps=[[50, 1], [10, 1], [100, 1]])
    with pytest.raises(ApplicationError, match="1 to 1440 minutes"):
        _start(pair, steps=[[100, 0]])
    _start(pair)
    other = deployment_of(team=team, node=cpu_node, name="chat-v3")
    with pytest.raises(ApplicationError, match="already has a rollout in progress"):
        rollout_start(served_model=pair.served, to_deployment=other, from_deployment=pair.old)


def test_a_good_rollout_steps_up_and_is_promoted(pair):
    from portal.rollouts.services import rollout_evaluate

    t0 = timezone.now()
    rollout = _start(pair)
    old, new = pair.old.model_version.name, pair.new.model_version.name
    assert rollout_evaluate(rollout=rollout, now=t0) == "serving"  # the new deployment serves: step 1
    assert shares_of(pair.served) == {old: 9_000, new: 1_000}

    measured(pair.new, t0, requests=30)
    measured(pair.old, t0, requests=270)
    assert rollout_evaluate(rollout=rollout, now=t0 + dt.timedelta(seconds=30)) == "hold"  # not a minute yet
    t1 = t0 + dt.timedelta(seconds=61)
    assert rollout_evaluate(rollout=rollout, now=t1) == "advanced"
    assert shares_of(pair.served) == {old: 0, new: 10_000}

    measured(pair.new, t1, requests=300)
    assert rollout_evaluate(rollout=rollout, now=t1 + dt.timedelta(seconds=61)) == "promoted"
    rollout.refresh_from_db()
    assert rollout.state == "promoted" and rollout.finished_at is not None
    _assert_stopped_after_the_route_cache(rollout, pair.old)
    assert _kinds(rollout) == ["start", "step", "step", "promote", "stop"]


def _assert_stopped_after_the_route_cache(rollout, deployment) -> None:
    """The deployment that left the traffic is asked to stop once every gateway process has seen
    its share at 0 (one GATEWAY_CACHE_S later), once, by the next tick past that."""
    from django.conf import settings

    from portal.rollouts.services import rollouts_stop_due

    deployment.refresh_from_db()
    assert deployment.desired_state == "running"  # gateways may still send it a request now
    assert rollouts_stop_due(now=timezone.now()) == []
    due = timezone.now() + dt.timedelta(seconds=settings.GATEWAY_CACHE_S + 2)
    assert rollouts_stop_due(now=due) == [rollout.pk]
    assert rollouts_stop_due(now=due) == []  # claimed once
    deployment.refresh_from_db()
    assert deployment.desired_state == "stopped"  # the agent drains it, then stops it


def test_a_step_without_enough_traffic_holds(pair, settings):
    from portal.rollouts.services import rollout_evaluate

    settings.ROLLOUT_MIN_REQUESTS = 20
    t0 = timezone.now()
    rollout = _start(pair)
    rollout_evaluate(rollout=rollout, now=t0)
    measured(pair.new, t0, requests=3)
    assert rollout_evaluate(rollout=rollout, now=t0 + dt.timedelta(minutes=5)) == "hold"


def test_a_breach_of_the_sla_rolls_back_within_one_evaluation(pair):
    from portal.rollouts.services import rollout_evaluate

    t0 = timezone.now()
    rollout = _start(pair)
    rollout_evaluate(rollout=rollout, now=t0)
    measured(pair.new, t0, requests=5, ttft_ms=5_000)  # SLA: 3 s
    measured(pair.old, t0, requests=95)

    assert rollout_evaluate(rollout=rollout, now=t0 + dt.timedelta(seconds=20)) == "rolled_back"
    rollout.refresh_from_db()
    assert shares_of(pair.served) == {pair.old.model_version.name: 10_000, pair.new.model_version.name: 0}
    assert rollout.state == "rolled_back"
    assert "P95 TTFT 5000 ms > SLA 3000 ms" in rollout.reason
    assert rollout.measurements["new"]["p95_ttft_ms"] == 5000.0  # the numbers it decided on
    assert _kinds(rollout)[-1] == "roll_back"
    _assert_stopped_after_the_route_cache(rollout, pair.new)
    pair.old.refresh_from_db()
    assert pair.old.desired_state == "running"


def test_errors_above_the_old_versions_roll_back(pair):
    from portal.rollouts.services import rollout_evaluate

    t0 = timezone.now()
    rollout = _start(pair)
    rollout_evaluate(rollout=rollout, now=t0)
    measured(pair.new, t0, requests=40, errors=4)
    measured(pair.old, t0, requests=360, errors=1)
    assert rollout_evaluate(rollout=rollout, now=t0 + dt.timedelta(seconds=20)) == "rolled_back"
    rollout.refresh_from_db()
    assert "error rate 10.0% (4/40)" in rollout.reason


def test_slower_than_the_old_version_rolls_back_even_within_the_sla(pair):
    from portal.rollouts.services import rollout_evaluate

    t0 = timezone.now()
    rollout = _start(pair)
    rollout_evaluate(rollout=rollout, now=t0)
    measured(pair.new, t0, requests=40, ttft_ms=1_500)
    measured(pair.old, t0, requests=360, ttft_ms=500)
    assert rollout_evaluate(rollout=rollout, now=t0 + dt.timedelta(seconds=20)) == "rolled_back"
    rollout.refresh_from_db()
    assert "1.5 × old version's 500.0 ms" in rollout.reason


def test_pause_stops_advancing_and_resume_goes_on(pair, alice):
    from portal.rollouts.services import rollout_evaluate, rollout_pause, rollout_resume

    t0 = timezone.now()
    rollout = _start(pair)
    rollout_evaluate(rollout=rollout, now=t0)
    measured(pair.new, t0, requests=30)
    rollout_pause(rollout=rollout, actor=alice)
    later = t0 + dt.timedelta(minutes=3)
    assert rollout_evaluate(rollout=rollout, now=later) == "-"
    rollout.refresh_from_db()
    assert (rollout.state, rollout.current_step) == ("paused", 0)
    assert shares_of(pair.served)[pair.new.model_version.name] == 1_000

    rollout = rollout_resume(rollout=rollout, actor=alice)
    assert (rollout.state, rollout.current_step) == ("stepping", 0)
    resumed = rollout.step_started_at
    measured(pair.new, resumed, requests=30)
    assert rollout_evaluate(rollout=rollout, now=resumed + dt.timedelta(seconds=61)) == "advanced"
    assert _kinds(rollout) == ["start", "step", "pause", "resume", "step"]


def test_operators_promote_or_roll_back_by_hand(pair, team, cpu_node, alice):
    from portal.audit.models import AuditEvent
    from portal.core.errors import ApplicationError
    from portal.rollouts.services import rollout_evaluate, rollout_promote, rollout_rollback

    rollout = _start(pair)
    rollout_evaluate(rollout=rollout)
    rollout = rollout_rollback(rollout=rollout, actor=alice, reason="bad answers in review")
    assert rollout.state == "rolled_back" and "by alice: bad answers in review" in rollout.reason
    with pytest.raises(ApplicationError, match="cannot be promoted"):
        rollout_promote(rollout=rollout, actor=alice)

    second = make_pair(team=team, node=cpu_node)
    rollout = _start(second)
    rollout = rollout_promote(rollout=rollout, actor=alice)
    assert rollout.state == "promoted"
    assert shares_of(second.served)[second.new.model_version.name] == 10_000
    assert AuditEvent.objects.filter(action="rollout.promote", actor=alice).count() == 1
    assert AuditEvent.objects.filter(action="rollout.roll_back", actor=alice).count() == 1


def test_a_new_deployment_that_fails_fails_the_rollout(db, team, cpu_node):
    from portal.deployments.models import Deployment
    from portal.rollouts.services import rollout_evaluate

    pair = make_pair(team=team, node=cpu_node, new_state="starting")
    rollout = _start(pair)
    assert rollout_evaluate(rollout=rollout) == "warming"
    Deployment.objects.filter(pk=pair.new.pk).update(state="failed", state_reason="smoke test failed")
    assert rollout_evaluate(rollout=rollout) == "failed"
    rollout.refresh_from_db()
    assert rollout.reason == f"the new deployment {pair.new.name} is failed: smoke test failed"
    assert shares_of(pair.served)[pair.new.model_version.name] == 0


@pytest.mark.django_db(transaction=True)
def test_two_workers_evaluating_at_once_advance_a_step_once(team, cpu_node):
    """Each thread is a worker with its own connection; the conditional update lets one win."""
    from portal.registry.models import ServedModelVersion
    from portal.rollouts.services import rollout_evaluate

    pair = make_pair(team=team, node=cpu_node)
    t0 = timezone.now()
    rollout = _start(pair, steps=[[10, 1], [50, 1], [100, 1]])
    rollout_evaluate(rollout=rollout, now=t0)
    measured(pair.new, t0, requests=30)
    results: list[str] = []
    barrier = threading.Barrier(4)

    def worker() -> None:
        try:
            barrier.wait()
            results.append(rollout_evaluate(rollout=rollout, now=t0 + dt.timedelta(seconds=61)))
        finally:
            connection.close()

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results.count("advanced") == 1, results
    rollout.refresh_from_db()
    assert rollout.current_step == 1
    assert _kinds(rollout) == ["start", "step", "step"]
    assert ServedModelVersion.objects.get(model_version=pair.new.model_version).share_bp == 5_000


def test_the_beat_task_is_scheduled_bounded_and_evaluates_active_rollouts(pair):
    from django.conf import settings

    from portal.celery import app
    from portal.rollouts.tasks import advance_all

    app.loader.import_default_modules()
    entry = settings.CELERY_BEAT_SCHEDULE["rollouts-advance"]
    assert entry["task"] in app.tasks
    assert entry["schedule"] == settings.ROLLOUT_TICK_S == 15
    rollout = _start(pair)
    assert advance_all() == {str(rollout.pk): "serving"}
    assert advance_all() == {str(rollout.pk): "hold"}


@pytest.mark.parametrize(
    "name, value",
    [
        ("ROLLOUT_TICK_S", "0"),
        ("ROLLOUT_MAX_LATENCY_RATIO", "0.5"),
        ("ROLLOUT_MAX_ERROR_RATE", "0"),
        ("ROLLOUT_LATENCY_MARGIN_SLA_FRACTION", "2"),
        ("ROLLOUT_LATENCY_MARGIN_MIN_MS", "-1"),
    ],
)
def test_rollout_settings_are_bounded(name, value, monkeypatch):
    import subprocess
    import sys

    monkeypatch.setenv(name, value)
    done = subprocess.run(
        [sys.executable, "-c", "import portal.settings"], capture_output=True, text=True, check=False
    )
    assert done.returncode != 0
    assert name in done.stderr


def test_a_stepping_rollout_is_measured_at_its_own_interval(pair):
    from portal.rollouts.services import rollout_start, rollouts_advance_all

    rollout = rollout_start(
        served_model=pair.served, to_deployment=pair.new, from_deployment=pair.old,
        steps=[{"share_percent": 50, "seconds": 30}, [100, 1]], interval_s=20, min_requests=3,
    )  # fmt: skip
    assert (rollout.interval_s, rollout.min_requests) == (20, 3)
    t0 = timezone.now()
    assert rollouts_advance_all(now=t0) == {rollout.pk: "serving"}
    assert rollouts_advance_all(now=t0 + dt.timedelta(seconds=1)) == {rollout.pk: "hold"}  # first measurement
    assert rollouts_advance_all(now=t0 + dt.timedelta(seconds=10)) == {}  # not due: 9 s of its 20
    assert rollouts_advance_all(now=t0 + dt.timedelta(seconds=21)) == {rollout.pk: "hold"}


def test_two_versions_both_failing_pause_the_rollout_as_an_outage(pair):
    from portal.rollouts.services import rollout_evaluate

    t0 = timezone.now()
    rollout = _start(pair)
    rollout_evaluate(rollout=rollout, now=t0)
    measured(pair.new, t0, requests=38, errors=38)
    measured(pair.old, t0, requests=146, errors=146)
    assert rollout_evaluate(rollout=rollout, now=t0 + dt.timedelta(minutes=2)) == "outage"
    rollout.refresh_from_db()
    assert rollout.state == "paused" and rollout.current_step == 0
    assert "outage: both versions fail" in rollout.reason
    assert shares_of(pair.served)[pair.new.model_version.name] == 1_000  # held where it was
    assert rollout.measurements["rule"] == "outage"
    assert _kinds(rollout)[-1] == "outage"


def test_a_step_that_is_tens_of_ms_slower_against_a_seconds_sla_advances(pair):
    from portal.rollouts.services import rollout_evaluate

    t0 = timezone.now()
    rollout = _start(pair)
    rollout_evaluate(rollout=rollout, now=t0)
    measured(pair.new, t0, requests=40, ttft_ms=103.9)
    measured(pair.old, t0, requests=360, ttft_ms=60.0)
    assert rollout_evaluate(rollout=rollout, now=t0 + dt.timedelta(minutes=1, seconds=1)) == "advanced"
    rollout.refresh_from_db()
    assert rollout.measurements["rule"] == "step_passed"
    assert rollout.measurements["new"]["p95_ttft_ms"] == 103.9


def test_the_old_version_is_measured_over_the_new_versions_minutes_only(pair):
    from portal.rollouts.services import rollout_evaluate, step_windows

    t0 = timezone.now().replace(second=30)
    rollout = _start(pair)
    rollout_evaluate(rollout=rollout, now=t0)
    measured(pair.old, t0, requests=200, ttft_ms=900)  # before the new version had any traffic
    measured(pair.new, t0 + dt.timedelta(minutes=1), requests=40, ttft_ms=120)
    measured(pair.old, t0 + dt.timedelta(minutes=1), requests=200, ttft_ms=110)
    rollout.refresh_from_db()
    new, old = step_windows(rollout, now=t0 + dt.timedelta(minutes=1))
    assert (new.requests, old.requests, old.p95_ttft_ms) == (40, 200, 110)
