"""Usage records: the flush from Redis (exactly once), the daily rollup, budgets."""

from __future__ import annotations

import datetime as dt
import json
import os
import time
import uuid

import pytest
import redis
from django.utils import timezone

from portal.core.redis_client import redis_keys
from portal.teams.models import ApiKey, Team, Usage, UsageDaily
from portal.teams.services import api_key_create, budgets_enforce, usage_flush, usage_rollup

pytestmark = pytest.mark.django_db


def _clear(client: redis.Redis) -> None:
    stale = [*client.scan_iter(f"{redis_keys().gateway}*"), *client.scan_iter(f"{redis_keys().metrics}*")]
    if stale:
        client.delete(*stale)


@pytest.fixture
def gw(settings):
    settings.GATEWAY_REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/15")
    client = redis.Redis.from_url(settings.GATEWAY_REDIS_URL)
    _clear(client)
    yield client
    _clear(client)
    client.close()


@pytest.fixture
def key(team):
    return api_key_create(team=team)[0]


def record(
    team, key=None, *, status="completed", prompt=10, completion=20, when=None, request_id=None
) -> dict:
    return {
        "request_id": request_id or uuid.uuid4().hex,
        "created_at": (when or timezone.now()).timestamp(),
        "team_id": team.pk,
        "api_key_id": key.pk if key else None,
        "model": "m1",
        "deployment_id": None,
        "endpoint": "chat",
        "stream": True,
        "status": status,
        "http_status": 200 if status == "completed" else 429,
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "ttft_ms": 12.5,
        "duration_ms": 80.0,
    }


def push(client, *records) -> None:
    client.rpush(redis_keys().usage, *[json.dumps(r) for r in records])



def test_it_flushes_queued_records_into_the_database(team, gw):
    key, _ = api_key_create(team=team)
    push(gw, record(team, key), record(team, key, status="rejected", prompt=0, completion=0))
    assert usage_flush() == 2
    assert sorted(Usage.objects.values_list("status", flat=True)) == ["completed", "rejected"]
    assert gw.llen(redis_keys().usage) == 0
    key.refresh_from_db()
    assert key.last_used_at is not None


def test_it_writes_a_record_pushed_twice_only_once(team, key, gw):
    # A flusher that crashed after inserting but before trimming re-reads the same records.
    same = record(team, key)
    push(gw, same, same)
    usage_flush()
    push(gw, same)
    usage_flush()
    assert Usage.objects.count() == 1


def test_it_drops_records_of_deleted_teams_and_garbage(team, key, gw):
    gone = Team.objects.create(name="Gone", slug="gone")
    push(gw, record(gone), record(team, key))
    gw.rpush(redis_keys().usage, b"not json")
    Team.objects.filter(pk=gone.pk).delete()
    usage_flush()
    assert list(Usage.objects.values_list("team_id", flat=True)) == [team.pk]


def test_it_rolls_up_a_day_per_team_key_and_model(team, gw):
    key, _ = api_key_create(team=team)
    yesterday = timezone.now() - dt.timedelta(days=1)
    push(
        gw,
        record(team, key),
        record(team, key, status="rejected", prompt=0, completion=0),
        record(team, key, status="upstream_error", prompt=5, completion=1),
        record(team, key, when=yesterday),
    )
    usage_flush()
    usage_rollup(day=timezone.now().date())
    usage_rollup(day=timezone.now().date())  # idempotent: recomputed, not added
    row = UsageDaily.objects.get(day=timezone.now().date())
    assert (row.requests, row.completed, row.rejected, row.failed) == (3, 1, 1, 1)
    assert (row.prompt_tokens, row.completion_tokens) == (15, 21)


@pytest.mark.django_db(transaction=True)
def test_it_disables_a_team_and_a_key_over_their_daily_budget_until_midnight(team, gw):
    team.tokens_per_day = 50
    team.save()
    key, _ = api_key_create(team=team, tokens_per_day=25)
    other, _ = api_key_create(team=team)
    push(gw, record(team, key, prompt=10, completion=20), record(team, other, prompt=10, completion=10))
    usage_flush()
    today = timezone.now().date()
    usage_rollup(day=today)
    disabled = budgets_enforce(day=today)
    assert sorted(disabled) == sorted(["team search", f"key {key}"])
    team.refresh_from_db()
    key.refresh_from_db()
    midnight = dt.datetime.combine(today + dt.timedelta(days=1), dt.time.min, tzinfo=dt.UTC)
    assert team.disabled_until == midnight and key.disabled_until == midnight
    assert not ApiKey.objects.get(pk=other.pk).is_disabled()
    ttl_ms = gw.pttl(redis_keys().blocked("team", team.pk))
    assert 0 < ttl_ms <= (midnight.timestamp() - time.time()) * 1000 + 1000
    assert budgets_enforce(day=today) == []  # already disabled


def test_a_record_with_unstorable_text_does_not_fail_the_batch(gw, team, key):
    bad = {**record(team, key), "model": "m\x00\ud800x"}  # json.dumps keeps them as \u escapes
    good = record(team, key)
    push(gw, bad, good)
    assert usage_flush() == 2
    assert sorted(Usage.objects.values_list("model", flat=True)) == ["m1", "m?x"]

