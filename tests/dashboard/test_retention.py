"""The daily retention prune: usage rolled up before its records go, old rows deleted in batches."""

from __future__ import annotations

import datetime as dt
import uuid

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from portal.audit.models import AppendOnlyError, AuditEvent
from portal.audit.services import audit_event_record
from portal.core import services as core_services
from portal.dashboard.services import retention_prune
from portal.deployments.models import DeploymentEvent, MetricsSample
from portal.teams.models import Usage, UsageDaily
from portal.teams.services import usage_rollup
from tests.helpers import builders
from tests.helpers.manage import PRODUCTION, manage

pytestmark = pytest.mark.django_db

NOW = dt.datetime(2026, 6, 15, 12, 0, tzinfo=dt.UTC)
OLD_DAY = dt.date(2026, 6, 1)
RECENT_DAY = dt.date(2026, 6, 14)


def _usage(team, day: dt.date, *, minute: int, model: str = "m", tokens: int = 10) -> Usage:
    return Usage.objects.create(
        request_id=uuid.uuid4(),
        created_at=dt.datetime.combine(day, dt.time(10), tzinfo=dt.UTC) + dt.timedelta(minutes=minute),
        team=team,
        model=model,
        status="completed",
        http_status=200,
        prompt_tokens=tokens,
        completion_tokens=2 * tokens,
        duration_ms=5,
    )


@pytest.fixture
def retention(settings):
    settings.RETENTION_USAGE_DAYS = 7
    settings.RETENTION_BATCH_SIZE = 2
    return settings


def test_it_rolls_a_day_up_before_deleting_its_usage_records(retention, team):
    for minute in range(5):
        _usage(team, OLD_DAY, minute=minute, model="a" if minute < 3 else "b")
    recent = _usage(team, RECENT_DAY, minute=0)
    assert not UsageDaily.objects.filter(day=OLD_DAY).exists()  # the rollup task never saw that day

    done = retention_prune(now=NOW)

    assert done["usage"] == 5
    assert list(Usage.objects.values_list("pk", flat=True)) == [recent.pk]
    daily = {row.model: row for row in UsageDaily.objects.filter(day=OLD_DAY)}
    assert (daily["a"].requests, daily["a"].prompt_tokens, daily["a"].completion_tokens) == (3, 30, 60)
    assert (daily["b"].requests, daily["b"].completed) == (2, 2)
    assert all(row.closed for row in daily.values())
    # The rollup task can no longer recompute the day from records that are gone.
    usage_rollup(day=OLD_DAY)
    assert UsageDaily.objects.get(day=OLD_DAY, model="a").requests == 3


def test_a_prune_cut_short_mid_day_keeps_that_days_rollup_whole(retention, team, monkeypatch):
    for minute in range(5):
        _usage(team, OLD_DAY, minute=minute)
    real_delete = core_services.delete_in_batches

    def one_batch_then_die(queryset, *, batch_size):
        ids = list(queryset.values_list("pk", flat=True)[:batch_size])
        real_delete(queryset.filter(pk__in=ids), batch_size=batch_size)
        raise RuntimeError("worker killed")

    monkeypatch.setattr(core_services, "delete_in_batches", one_batch_then_die)
    with pytest.raises(RuntimeError):
        retention_prune(now=NOW)
    assert Usage.objects.count() == 3
    monkeypatch.setattr(core_services, "delete_in_batches", real_delete)

    retention_prune(now=NOW)

    assert not Usage.objects.exists()
    assert UsageDaily.objects.get(day=OLD_DAY).requests == 5


def test_it_deletes_old_events_samples_and_audit_events_in_batches(
    retention, team, llama7b, profile_tp1, cpu_node
):
    deployment = builders.deployment(
        name="old", team=team, model_version=llama7b, profile=profile_tp1, node=cpu_node
    )
    for _ in range(5):
        DeploymentEvent.objects.create(deployment=deployment, step="start", status="ok")
        MetricsSample.objects.create(deployment=deployment, healthy=True)
        audit_event_record(action="test.retention", target=deployment)
    retention.RETENTION_DEPLOYMENT_EVENTS_DAYS = 30
    retention.RETENTION_METRICS_SAMPLES_DAYS = 90  # younger than that: kept
    retention.RETENTION_AUDIT_DAYS = 30

    with CaptureQueriesContext(connection) as queries:
        done = retention_prune(now=timezone.now() + dt.timedelta(days=60))

    assert (done["deployment_events"], done["metrics_samples"], done["audit_events"]) == (5, 0, 5)
    assert not DeploymentEvent.objects.exists() and not AuditEvent.objects.exists()
    assert MetricsSample.objects.count() == 5
    deletes = 'DELETE FROM "deployments_deploymentevent"'
    event_deletes = [q for q in queries.captured_queries if q["sql"].startswith(deletes)]
    assert len(event_deletes) == 3  # 2 + 2 + 1 rows
    # The audit log still refuses deletion everywhere else.
    audit_event_record(action="test.retention", target=deployment)
    with pytest.raises(AppendOnlyError):
        AuditEvent.objects.all().delete()


def test_zero_days_keeps_rows_forever(retention, team, llama7b, profile_tp1, cpu_node):
    deployment = builders.deployment(
        name="kept", team=team, model_version=llama7b, profile=profile_tp1, node=cpu_node
    )
    audit_event_record(action="test.retention", target=deployment)
    retention.RETENTION_AUDIT_DAYS = 0
    done = retention_prune(now=timezone.now() + dt.timedelta(days=10_000))
    assert "audit_events" not in done
    assert AuditEvent.objects.filter(action="test.retention").count() == 1


def test_beat_runs_the_prune_daily_on_the_control_queue(settings):
    from celery.schedules import crontab

    from portal.celery import app

    entry = settings.CELERY_BEAT_SCHEDULE["retention-prune"]
    assert isinstance(entry["schedule"], crontab) and entry["options"]["queue"] == "control"
    app.loader.import_default_modules()
    assert entry["task"] in app.tasks


def test_the_beat_task_prunes_with_the_settings(retention, team):
    from portal.dashboard.tasks import retention_prune as task

    _usage(team, timezone.now().date() - dt.timedelta(days=30), minute=0)
    result = task.apply()
    assert result.successful(), result.traceback
    assert result.result["usage"] == 1 and not Usage.objects.exists()


def test_it_refuses_a_usage_retention_shorter_than_the_rollup_window():
    result = manage("check", env={**PRODUCTION, "RETENTION_USAGE_DAYS": "1"})
    assert result.returncode != 0
    assert "RETENTION_USAGE_DAYS=1 must be 0 (keep forever) or at least 2" in result.stderr
