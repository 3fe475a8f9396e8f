"""Production latency per deployment per minute, rolled up from usage records, and SLA breaches."""

from __future__ import annotations

import datetime as dt

import pytest

from portal.observability.models import LatencyMinute, SlaBreach
from portal.observability.services import (
    SLA_BREACH_MINUTES,
    _rollup_rows_python,
    latency_rollup,
    percentile_cont,
    sla_breaches_update,
)
from portal.teams.models import Usage
from tests.helpers import builders

pytestmark = pytest.mark.django_db
T0 = dt.datetime(2026, 11, 30, 12, 0, tzinfo=dt.UTC)
N = SLA_BREACH_MINUTES


def at(minutes: float = 0, seconds: float = 0) -> dt.datetime:
    return T0 + dt.timedelta(minutes=minutes, seconds=seconds)


@pytest.fixture
def deployment(team, llama7b, cpu_node):
    return builders.deployment(
        name="chat", team=team, model_version=llama7b, node=cpu_node, state="serving",
        sla_p95_ttft_s=1.0, sla_p95_tpot_s=0.1,
    )  # fmt: skip


def usage(deployment, at, *, ttft_ms=100.0, duration_ms=1000.0, tokens=10, status="completed", stream=True):
    return Usage.objects.create(
        created_at=at, team=deployment.team, deployment=deployment, model="m", status=status,
        http_status=200 if status == "completed" else 502, ttft_ms=ttft_ms, duration_ms=duration_ms,
        completion_tokens=tokens, stream=stream,
    )  # fmt: skip


def test_it_matches_postgresql_percentile_cont():
    assert percentile_cont([], 0.5) is None
    assert percentile_cont([7.0], 0.95) == 7.0
    assert percentile_cont([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5
    assert percentile_cont(list(map(float, range(1, 21))), 0.95) == pytest.approx(19.05)


def test_it_rolls_up_ttft_tpot_requests_and_errors_per_deployment_and_minute(deployment):
    for i in range(20):  # TTFT 100..2000 ms; TPOT (duration - TTFT) / 9 = 10..200 ms
        ttft = 100.0 * (i + 1)
        usage(deployment, T0 + dt.timedelta(seconds=i), ttft_ms=ttft, duration_ms=ttft + 9 * ttft / 10)
    usage(deployment, at(seconds=30), ttft_ms=None, duration_ms=50.0, tokens=0, status="upstream_error")
    usage(deployment, T0 + dt.timedelta(seconds=31), tokens=1)  # one token: no TPOT
    usage(deployment, T0 + dt.timedelta(minutes=1), ttft_ms=5000.0, duration_ms=6000.0)

    assert latency_rollup(since=T0, until=T0 + dt.timedelta(minutes=2)) == 2
    first, second = LatencyMinute.objects.order_by("minute")
    assert (first.minute, first.requests, first.errors) == (T0, 22, 1)
    ttfts = [100.0 * (i + 1) for i in range(20)] + [100.0]
    assert first.p50_ttft_ms == pytest.approx(percentile_cont(ttfts, 0.5))
    assert first.p95_ttft_ms == pytest.approx(percentile_cont(ttfts, 0.95))
    tpots = [10.0 * (i + 1) for i in range(20)]
    assert first.p50_tpot_ms == pytest.approx(percentile_cont(tpots, 0.5))
    assert first.p95_tpot_ms == pytest.approx(percentile_cont(tpots, 0.95))
    assert (second.minute, second.requests, second.p95_ttft_ms) == (T0 + dt.timedelta(minutes=1), 1, 5000.0)
    # The Python fallback (SQLite) computes the same rows.
    python_rows = sorted(_rollup_rows_python(T0, T0 + dt.timedelta(minutes=2)), key=lambda r: r[1])
    assert python_rows[0][:4] == (deployment.pk, T0, 22, 1)
    percentiles = (first.p50_ttft_ms, first.p95_ttft_ms, first.p50_tpot_ms, first.p95_tpot_ms)
    assert python_rows[0][4:8] == pytest.approx(percentiles)


def test_non_streamed_requests_count_toward_end_to_end_latency_not_ttft_or_tpot(deployment):
    """A non-streamed answer arrives whole: its "first byte" is its last, so it once made TTFT equal
    the whole latency and TPOT about 0, and an SLA on TTFT broke on the key page's own snippets."""
    for i in range(4):  # streamed: TTFT 200 ms, 1000 ms end to end, TPOT (1000 - 200) / 9
        usage(deployment, at(seconds=i), ttft_ms=200.0, duration_ms=1000.0)
    for i in range(4):  # non-streamed, recorded as the gateway once did: a "TTFT" of the whole answer
        usage(deployment, at(seconds=10 + i), ttft_ms=3000.0, duration_ms=3000.0, stream=False)
    usage(deployment, at(seconds=20), ttft_ms=None, duration_ms=3000.0, stream=False)  # as it does now
    latency_rollup(since=T0, until=at(minutes=1))
    [row] = LatencyMinute.objects.all()
    assert (row.requests, row.p50_ttft_ms, row.p95_ttft_ms) == (9, 200.0, 200.0)
    assert row.p95_tpot_ms == pytest.approx(800.0 / 9)
    e2e = [1000.0] * 4 + [3000.0] * 5
    assert (row.p50_e2e_ms, row.p95_e2e_ms) == (percentile_cont(e2e, 0.5), percentile_cont(e2e, 0.95))
    [python_row] = _rollup_rows_python(T0, at(minutes=1))
    assert python_row[4:] == pytest.approx(
        (200.0, 200.0, row.p50_tpot_ms, row.p95_tpot_ms, row.p50_e2e_ms, row.p95_e2e_ms)
    )
    # The deployment is inside a 1 s TTFT SLA: no breach from its non-streamed traffic.
    sla_breaches_update(now=at(minutes=N + 1))
    assert not SlaBreach.objects.exists()


def test_it_is_idempotent_and_takes_in_late_records(deployment):
    usage(deployment, T0 + dt.timedelta(seconds=5), ttft_ms=200.0)
    latency_rollup(since=T0, until=T0 + dt.timedelta(minutes=1))
    latency_rollup(since=T0, until=T0 + dt.timedelta(minutes=1))
    assert LatencyMinute.objects.get().requests == 1
    usage(deployment, T0 + dt.timedelta(seconds=50), ttft_ms=400.0)  # stored later, same minute
    latency_rollup(since=T0, until=T0 + dt.timedelta(minutes=1))
    row = LatencyMinute.objects.get()
    assert (row.requests, row.p50_ttft_ms) == (2, 300.0)


def breaking_minutes(deployment, start, count, *, ttft_ms=3000.0):
    for i in range(count):
        usage(deployment, start + dt.timedelta(minutes=i, seconds=10), ttft_ms=ttft_ms, duration_ms=ttft_ms)
    latency_rollup(since=start, until=start + dt.timedelta(minutes=count))


def test_it_opens_a_breach_after_five_breaking_minutes_in_a_row_and_not_before(deployment):
    breaking_minutes(deployment, T0, SLA_BREACH_MINUTES - 1)
    assert sla_breaches_update(now=at(N - 1, 5))["opened"] == []
    breaking_minutes(deployment, T0 + dt.timedelta(minutes=SLA_BREACH_MINUTES - 1), 1)
    done = sla_breaches_update(now=T0 + dt.timedelta(minutes=SLA_BREACH_MINUTES, seconds=5))
    assert done["opened"] == ["chat"]
    breach = SlaBreach.objects.get()
    assert (breach.started_at, breach.ended_at) == (T0, None)
    assert "P95 TTFT 3.00 s > 1 s" in breach.reason
    # Evaluated again: still the one open breach.
    assert sla_breaches_update(now=T0 + dt.timedelta(minutes=SLA_BREACH_MINUTES, seconds=30))["opened"] == []
    assert SlaBreach.objects.count() == 1


def test_a_minute_without_requests_or_inside_the_sla_breaks_the_streak(deployment):
    breaking_minutes(deployment, T0, 2)
    breaking_minutes(deployment, T0 + dt.timedelta(minutes=3), 2)  # minute 2 had no requests
    assert sla_breaches_update(now=T0 + dt.timedelta(minutes=5, seconds=1))["opened"] == []
    breaking_minutes(deployment, T0 + dt.timedelta(minutes=5), 1, ttft_ms=500.0)  # inside
    assert sla_breaches_update(now=T0 + dt.timedelta(minutes=6, seconds=1))["opened"] == []


def test_it_closes_the_breach_at_the_end_of_the_last_breaking_minute(deployment):
    breaking_minutes(deployment, T0, 7)
    sla_breaches_update(now=T0 + dt.timedelta(minutes=7))
    breaking_minutes(deployment, T0 + dt.timedelta(minutes=7), 1, ttft_ms=200.0)
    assert sla_breaches_update(now=T0 + dt.timedelta(minutes=8, seconds=3))["closed"] == ["chat"]
    breach = SlaBreach.objects.get()
    assert (breach.started_at, breach.ended_at) == (at(2), at(7))


def test_a_tpot_over_the_sla_also_breaches(deployment):
    for i in range(SLA_BREACH_MINUTES):  # TTFT fine, TPOT (2000 - 100) / 9 ≈ 211 ms > 100 ms
        usage(deployment, T0 + dt.timedelta(minutes=i), ttft_ms=100.0, duration_ms=2000.0)
    latency_rollup(since=T0, until=T0 + dt.timedelta(minutes=SLA_BREACH_MINUTES))
    assert sla_breaches_update(now=T0 + dt.timedelta(minutes=SLA_BREACH_MINUTES))["opened"] == ["chat"]
    assert "P95 TPOT 0.211 s > 0.1 s" in SlaBreach.objects.get().reason


def test_the_beat_schedule_rolls_up_latency_every_minute_with_a_registered_task():
    from django.conf import settings

    from portal.celery import app

    app.loader.import_default_modules()
    entry = settings.CELERY_BEAT_SCHEDULE["observability-latency-rollup"]
    assert entry["task"] in app.tasks
    assert entry["schedule"] == 60.0
    assert entry["options"]["queue"] == "control"


def test_the_task_stores_waiting_usage_records_before_rolling_up(deployment, gateway_redis_db, metrics_redis):
    """A record still in the Redis usage queue counts in its minute as soon as the task runs."""
    import json
    import uuid

    from django.utils import timezone

    from portal.core.redis.client import redis_keys
    from portal.observability.tasks import latency_rollup as task
    from portal.teams.services import api_key_create

    arrived = timezone.now() - dt.timedelta(minutes=2)
    record = {
        "request_id": uuid.uuid4().hex, "created_at": arrived.timestamp(), "team_id": deployment.team_id,
        "api_key_id": api_key_create(team=deployment.team)[0].pk, "model": "m",
        "deployment_id": deployment.pk, "endpoint": "chat",
        "stream": True, "status": "completed", "http_status": 200, "error_code": "", "prompt_tokens": 5,
        "completion_tokens": 11, "ttft_ms": 250.0, "duration_ms": 1250.0,
    }  # fmt: skip
    metrics_redis.rpush(redis_keys().usage, json.dumps(record))
    task.apply()
    row = LatencyMinute.objects.get(deployment=deployment)
    assert (row.requests, row.p95_ttft_ms, row.p95_tpot_ms) == (1, 250.0, 100.0)
