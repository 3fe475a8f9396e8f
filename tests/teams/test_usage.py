"""Usage records: the flush from Redis (exactly once), the daily rollup, budgets."""

from __future__ import annotations

import datetime as dt
import json
import threading
import time
import uuid

import pytest
from django.utils import timezone

from devtools import wait_until
from portal.core.redis.client import redis_keys
from portal.core.redis.scripts import USAGE_TAKE
from portal.teams.models import ApiKey, Team, Usage, UsageDaily
from portal.teams.services import api_key_create, budgets_enforce, usage_flush, usage_rollup
from tests.helpers import builders
from tests.helpers.usage import dead_letters, push, record

pytestmark = pytest.mark.django_db


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


def test_it_dead_letters_records_of_deleted_teams_and_garbage(team, key, gw):
    gone = builders.team(name="Gone", slug="gone")
    gone_key, _ = api_key_create(team=gone)
    lost = record(gone, gone_key)
    push(gw, lost, record(team, key))
    gw.rpush(redis_keys().usage, b"not json")
    Team.objects.filter(pk=gone.pk).delete()
    assert usage_flush() == 1
    assert list(Usage.objects.values_list("team_id", flat=True)) == [team.pk]
    assert sorted(dead_letters(gw), key=str) == [("unknown_team", lost), ("unreadable", "not json")]


def test_it_rolls_up_a_day_per_team_key_and_model(team, gw):
    key, _ = api_key_create(team=team)
    yesterday = timezone.now() - dt.timedelta(days=1)
    ApiKey.objects.filter(pk=key.pk).update(created_at=yesterday - dt.timedelta(hours=1))
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


@pytest.mark.slow  # out of make test-fast: seconds of work on 2 cores
@pytest.mark.django_db(transaction=True)
def test_it_stores_every_record_exactly_once_with_two_flushers_racing_new_arrivals(team, key, gw):
    # Beat's flush and the rollup's flush run at once on the control worker (two tasks at a time).
    from django.db import connection

    ids = [uuid.uuid4().hex for _ in range(10_000)]
    arrived = threading.Event()
    errors: list[BaseException] = []

    def arrive() -> None:
        for start in range(0, len(ids), 100):
            push(gw, *[record(team, key, request_id=i) for i in ids[start : start + 100]])
        arrived.set()

    def flush() -> None:
        try:
            while not arrived.is_set():
                usage_flush(batch=10)
            usage_flush(batch=10)
        except BaseException as error:  # reported by the test's thread
            errors.append(error)
        finally:
            connection.close()

    threads = [threading.Thread(target=target) for target in (arrive, flush, flush)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not errors and not any(t.is_alive() for t in threads)
    usage_flush()
    stored = {u.hex for u in Usage.objects.values_list("request_id", flat=True)}
    lost = set(ids) - stored
    assert not lost, f"{len(lost)} of {len(ids)} records lost"
    assert Usage.objects.count() == len(ids)
    assert gw.llen(redis_keys().usage) == 0 and dead_letters(gw) == []


@pytest.mark.django_db(transaction=True)
def test_two_flushers_holding_a_batch_at_the_same_moment_hold_different_records(team, key, gw, monkeypatch):
    from django.db import connection

    records = [record(team, key) for _ in range(30)]
    push(gw, *records)
    both_hold_one = threading.Barrier(2, timeout=10)
    first_batches: dict[int, set[str]] = {}
    from portal.teams.services import usage_queue as services

    insert = services.usage_insert

    def insert_once_both_hold_a_batch(rows):
        if threading.get_ident() not in first_batches:  # each flusher's first batch: wait for the other's
            first_batches[threading.get_ident()] = {r.request_id.hex for r in rows}
            both_hold_one.wait()
        return insert(rows)

    monkeypatch.setattr(services, "usage_insert", insert_once_both_hold_a_batch)

    def flush() -> None:
        try:
            usage_flush(batch=10)
        finally:
            connection.close()

    threads = [threading.Thread(target=flush) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    first, second = first_batches.values()
    assert len(first) == len(second) == 10 and not first & second
    assert sorted(u.hex for u in Usage.objects.values_list("request_id", flat=True)) == sorted(
        r["request_id"] for r in records
    )


def test_it_puts_back_the_batch_of_a_flusher_that_died_holding_it(team, key, gw, monkeypatch):

    records = [record(team, key) for _ in range(3)]
    push(gw, *records)
    # A flusher takes the batch and dies before storing it (its lease: 1 ms).
    keys = redis_keys()
    take = gw.register_script(USAGE_TAKE)
    taken = take(keys=[keys.usage, keys.usage_flushers, keys.usage_taken("dead")], args=[10, 1, "dead"])
    assert len(taken) == 3
    assert gw.llen(keys.usage) == 0
    # The lease ends within a millisecond.
    wait_until(usage_flush, timeout_s=5, interval_s=0.01, what="the dead flusher's records flushed")
    assert sorted(u.hex for u in Usage.objects.values_list("request_id", flat=True)) == sorted(
        r["request_id"] for r in records
    )
    assert not gw.exists(keys.usage_taken("dead")) and gw.zcard(keys.usage_flushers) == 0


def test_a_batch_the_database_could_not_take_goes_back_on_the_queue(team, key, gw, monkeypatch):
    from django.db import OperationalError

    from portal.teams.services import usage_queue as services

    push(gw, record(team, key), record(team, key))

    def database_down(raws):
        raise OperationalError("the database is restarting")

    monkeypatch.setattr(services, "_usage_store", database_down)
    with pytest.raises(OperationalError):
        usage_flush()
    assert gw.llen(redis_keys().usage) == 2 and gw.zcard(redis_keys().usage_flushers) == 0
    monkeypatch.undo()
    assert usage_flush() == 2


def test_a_record_postgresql_refuses_is_dead_lettered_counted_and_the_flush_goes_on(team, key, gw, client):
    from portal.observability.collector import exposition

    huge = record(team, key, prompt=2**31)  # over PostgreSQL's integer: an adopted upstream's count
    wrong_type = {**record(team, key), "http_status": "abc"}
    before, after = record(team, key), record(team, key)
    push(gw, before, huge, wrong_type, after)
    assert usage_flush() == 2
    assert sorted(u.hex for u in Usage.objects.values_list("request_id", flat=True)) == sorted(
        [before["request_id"], after["request_id"]]
    )
    assert dead_letters(gw) == [("refused_by_database", huge), ("refused_by_database", wrong_type)]
    push(gw, record(team, key))  # the next flush is not stuck behind it
    assert usage_flush() == 1
    text = exposition().decode()
    assert 'portal_usage_dead_letters_total{reason="refused_by_database"} 2.0' in text
    assert "portal_usage_dead_letter_records 2.0" in text


def test_it_dead_letters_records_of_keys_this_database_does_not_know(team, key, gw):
    # Records queued by another portal on the same Redis: its team and key ids mean nothing here.
    other = builders.team(name="Other", slug="other")
    other_key, _ = api_key_create(team=other)
    stranger = {**record(team, key), "api_key_id": 10**9}
    wrong_team = {**record(team, key), "api_key_id": other_key.pk}  # a key id of another team
    no_key = {**record(team, key), "api_key_id": None}
    # Queued before this key existed: a recreated database numbers keys from 1 again.
    before_the_key = record(team, key, when=key.created_at - dt.timedelta(hours=1))
    ours = record(team, key)
    push(gw, stranger, wrong_team, no_key, before_the_key, ours)
    assert usage_flush() == 1
    assert [u.hex for u in Usage.objects.values_list("request_id", flat=True)] == [ours["request_id"]]
    assert dead_letters(gw) == [("unknown_key", r) for r in (stranger, wrong_team, no_key, before_the_key)]


def test_it_ignores_the_usage_records_of_another_installation_on_the_same_redis(team, key, gw, settings):
    from portal.core.redis.keys import RedisKeys

    theirs = RedisKeys("another-portal")
    try:
        gw.rpush(theirs.usage, json.dumps(record(team, key)))
        assert usage_flush() == 0
        assert Usage.objects.count() == 0 and gw.llen(theirs.usage) == 1
    finally:
        gw.delete(theirs.usage)


def test_ops_inspect_replay_and_purge_the_dead_letters(team, key, gw):
    from io import StringIO

    from django.core.management import call_command

    def command(*args: str) -> str:
        out = StringIO()
        call_command("usage_dead_letters", *args, stdout=out)
        return out.getvalue()

    refused = {**record(team, key), "api_key_id": 10**9}
    push(gw, refused)
    usage_flush()
    shown = command("--show", "5")
    assert "1 dead-lettered usage record(s)" in shown and "unknown_key: 1" in shown
    assert refused["request_id"] in shown
    assert command("--replay") == "1 record(s) back on the queue for the next flush\n"
    assert [json.loads(r) for r in gw.lrange(redis_keys().usage, 0, -1)] == [refused]
    usage_flush()  # still unknown: dead-lettered again
    assert command("--purge") == "1 record(s) forgotten\n"
    assert dead_letters(gw) == [] and Usage.objects.count() == 0


# Committed: the flush's COPY staging table empties at each commit, which a test transaction never makes.
@pytest.mark.django_db(transaction=True)
def test_a_record_of_a_day_retention_closed_is_dead_lettered_and_replay_leaves_it(team, key, gw):
    """Was stored, never counted (the closed day's rollups are final) and deleted at the next prune."""
    from io import StringIO

    from django.core.management import call_command

    from portal.teams.services import usage_prune

    old = timezone.now() - dt.timedelta(days=10)
    ApiKey.objects.filter(pk=key.pk).update(created_at=old - dt.timedelta(days=1))
    push(gw, record(team, key, when=old))
    assert usage_flush() == 1
    usage_prune(before=timezone.now().date() - dt.timedelta(days=5), batch_size=100)
    day = old.astimezone(dt.UTC).date()
    assert UsageDaily.objects.get(day=day).closed
    late = record(team, key, when=old + dt.timedelta(minutes=1))  # a late flush, or a replay
    fresh = record(team, key)
    push(gw, late, fresh)
    assert usage_flush() == 1
    assert dead_letters(gw) == [("day_closed", late)]
    assert list(Usage.objects.values_list("request_id", flat=True)) == [uuid.UUID(fresh["request_id"])]
    assert UsageDaily.objects.get(day=day).requests == 1
    out = StringIO()
    call_command("usage_dead_letters", "--replay", stdout=out)
    assert out.getvalue().splitlines() == [
        "0 record(s) back on the queue for the next flush",
        "1 record(s) of days retention has closed left dead-lettered: those days' usage is final and "
        "would never count them (--purge forgets them)",
    ]
    assert dead_letters(gw) == [("day_closed", late)] and gw.llen(redis_keys().usage) == 0


def test_it_leaves_refused_and_unavailable_prompts_out_of_the_rolled_up_tokens(team, key, gw):
    """Three refused 300 KB prompts once put 225,012 prompt tokens into the team's rollup."""
    push(
        gw,
        record(team, key, prompt=10, completion=20),
        record(team, key, status="rejected", prompt=75_004, completion=0),
        record(team, key, status="unavailable", prompt=500, completion=0),
    )
    usage_flush()
    usage_rollup(day=timezone.now().date())
    row = UsageDaily.objects.get(day=timezone.now().date())
    assert (row.prompt_tokens, row.completion_tokens) == (10, 20)


def test_it_counts_outages_apart_from_refusals_in_the_rollups(team, key, gw):
    push(
        gw,
        *[record(team, key, status="unavailable", prompt=0, completion=0) for _ in range(3)],
        record(team, key, status="rejected", prompt=0, completion=0),
        record(team, key, status="upstream_error", prompt=5, completion=1),
    )
    usage_flush()
    usage_rollup(day=timezone.now().date())
    row = UsageDaily.objects.get(day=timezone.now().date())
    assert (row.requests, row.rejected, row.unavailable, row.failed) == (5, 1, 3, 1)
