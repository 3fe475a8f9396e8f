"""The usage record both ends share: what the gateway queues is what the flush reads back."""

from __future__ import annotations

import datetime as dt
import json
import uuid

import pytest

from portal.teams.models import PriorityClass, UsageStatus
from portal.teams.usage_record import UnreadableUsageRecord, UsageRecord


def a_record(**changes) -> UsageRecord:
    fields = {
        "request_id": uuid.UUID(int=0xABC),
        "created_at": dt.datetime(2026, 3, 1, 12, 30, 5, 123456, tzinfo=dt.UTC),
        "team_id": 3,
        "api_key_id": 7,
        "model": "m1",
        "deployment_id": 11,
        "endpoint": "chat",
        "priority_class": PriorityClass.BATCH,
        "stream": True,
        "status": UsageStatus.TIMEOUT,
        "http_status": 504,
        "error_code": "upstream_timeout",
        "prompt_tokens": 10,
        "completion_tokens": 2,
        "ttft_ms": 12.5,
        "duration_ms": 30_000.0,
    }
    return UsageRecord(**{**fields, **changes})


def test_it_reads_back_exactly_what_it_wrote():
    record = a_record()
    assert UsageRecord.from_json(record.to_json()) == record
    assert UsageRecord.from_json(record.to_json().encode()) == record


def test_its_json_is_plain_values_under_the_keys_the_queue_has_always_held():
    data = json.loads(a_record().to_json())
    assert data == {
        "request_id": "00000000000000000000000000000abc",
        "created_at": dt.datetime(2026, 3, 1, 12, 30, 5, 123456, tzinfo=dt.UTC).timestamp(),
        "team_id": 3,
        "api_key_id": 7,
        "model": "m1",
        "deployment_id": 11,
        "endpoint": "chat",
        "priority_class": "batch",
        "stream": True,
        "status": "timeout",
        "http_status": 504,
        "error_code": "upstream_timeout",
        "prompt_tokens": 10,
        "completion_tokens": 2,
        "ttft_ms": 12.5,
        "duration_ms": 30_000.0,
    }


def test_a_record_from_before_priority_classes_and_error_codes_reads_as_interactive():
    data = a_record().to_dict()
    del data["priority_class"], data["error_code"]
    record = UsageRecord.from_json(json.dumps(data))
    assert (record.priority_class, record.error_code) == (PriorityClass.INTERACTIVE, "")


def test_an_id_that_is_no_integer_reads_as_none():
    data = {**a_record().to_dict(), "api_key_id": "7", "deployment_id": 1.5}
    record = UsageRecord.from_json(json.dumps(data))
    assert (record.api_key_id, record.deployment_id) == (None, None)


@pytest.mark.parametrize(
    "raw",
    [
        b"not json",
        b"[1, 2]",
        json.dumps({**a_record().to_dict(), "status": "finished"}),  # no status the portal knows
        json.dumps({**a_record().to_dict(), "request_id": 12}),
        json.dumps({k: v for k, v in a_record().to_dict().items() if k != "team_id"}),
        json.dumps({**a_record().to_dict(), "prompt_tokens": "many"}),
    ],
)
def test_what_is_no_usage_record_is_unreadable(raw):
    with pytest.raises(UnreadableUsageRecord):
        UsageRecord.from_json(raw)


@pytest.mark.django_db
def test_the_flush_stores_what_the_gateway_writes_and_dead_letters_an_unknown_status(team, key, gw):
    from portal.core.redis.client import redis_keys
    from portal.teams.models import Usage
    from portal.teams.services import usage_flush

    ours = a_record(
        team_id=team.pk, api_key_id=key.pk, deployment_id=None, created_at=dt.datetime.now(dt.UTC)
    )
    unknown = {**a_record(team_id=team.pk, api_key_id=key.pk).to_dict(), "status": "finished"}
    gw.rpush(redis_keys().usage, ours.to_json(), json.dumps(unknown))
    assert usage_flush() == 1
    row = Usage.objects.get()
    assert (row.request_id, row.created_at, row.status, row.priority_class) == (
        ours.request_id,
        ours.created_at,
        UsageStatus.TIMEOUT,
        PriorityClass.BATCH,
    )
    assert [json.loads(e)["reason"] for e in gw.lrange(redis_keys().usage_dead, 0, -1)] == ["unreadable"]


@pytest.mark.django_db
def test_a_record_of_a_deployment_deleted_since_is_stored_unlinked(team, key, gw):
    from portal.core.redis.client import redis_keys
    from portal.teams.models import Usage
    from portal.teams.services import usage_flush

    gone = a_record(
        team_id=team.pk, api_key_id=key.pk, deployment_id=10**9, created_at=dt.datetime.now(dt.UTC)
    )
    gw.rpush(redis_keys().usage, gone.to_json())
    assert usage_flush() == 1
    assert Usage.objects.get().deployment_id is None
