"""Usage numbers from the upstream are not trusted: whatever a usage object holds, the request
finishes (slots released, one usage row) and is billed within what it reserved."""

from __future__ import annotations

import httpx
import pytest
from django.utils import timezone

from portal.core.redis.client import redis_keys
from tests.helpers.gateway import chat_body, wait_for_slots_free

pytestmark = [pytest.mark.django_db(transaction=True)]

MAX_TOKENS = 7
# `FAKE bad_usage=N` (perf/fake_upstream.py): completion_tokens "three", [3], -1000, 10**9.
BAD_USAGE = {"a word": 1, "a list": 2, "a negative": 3, "past the reservation": 4}


def _post(gateway, setup, content: str, *, stream: bool) -> httpx.Response:
    setup.team.tokens_per_day = 100_000  # so the day's counter exists, to compare with the row
    setup.team.save()
    body = chat_body(setup.model, content, stream=stream, max_tokens=MAX_TOKENS)
    return httpx.post(f"{gateway.url}/v1/chat/completions", headers=setup.headers, json=body, timeout=30)


def _rows(setup):
    from portal.teams.models import Usage
    from portal.teams.services import usage_flush

    usage_flush()
    return list(Usage.objects.filter(team=setup.team))


def _day_counter(gw_redis, setup) -> int:
    day = int(timezone.now().timestamp() // 86400)
    return int(gw_redis.get(redis_keys().tpd_prefix("team", setup.team.pk) + str(day)) or 0)


@pytest.mark.parametrize("bad", BAD_USAGE.values(), ids=BAD_USAGE.keys())
def test_a_stream_with_a_bad_usage_count_finishes_and_is_billed_within_its_reservation(
    gateway, serving, gw_redis, bad
):
    response = _post(gateway, serving, f"FAKE bad_usage={bad}", stream=True)
    assert response.status_code == 200 and response.text.endswith("data: [DONE]\n\n")
    assert not any(wait_for_slots_free(gw_redis, serving, timeout=10).values())
    [row] = _rows(serving)
    assert row.status == "completed"
    assert 0 <= row.completion_tokens <= MAX_TOKENS
    assert _day_counter(gw_redis, serving) == row.prompt_tokens + row.completion_tokens


@pytest.mark.parametrize("bad", BAD_USAGE.values(), ids=BAD_USAGE.keys())
def test_a_whole_answer_with_a_bad_usage_count_is_billed_within_its_reservation(
    gateway, serving, gw_redis, bad
):
    response = _post(gateway, serving, f"FAKE bad_usage={bad}", stream=False)
    assert response.status_code == 200
    assert not any(wait_for_slots_free(gw_redis, serving, timeout=10).values())
    [row] = _rows(serving)
    assert (row.status, row.http_status) == ("completed", 200)
    assert 0 <= row.completion_tokens <= MAX_TOKENS
    assert _day_counter(gw_redis, serving) == row.prompt_tokens + row.completion_tokens


def test_an_upstream_reporting_a_bad_count_is_logged_once_naming_its_replica(gateway, serving, gw_redis):
    _post(gateway, serving, "FAKE bad_usage=4", stream=True)
    _rows(serving)
    lines = [line for line in gateway.log_text().splitlines() if "out of bounds" in line]
    assert any(serving.deployment.name in line for line in lines)
