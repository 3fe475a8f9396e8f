"""Usage records, key handling and the key's view of models, through the real gateway."""

from __future__ import annotations

import datetime as dt

import httpx
import pytest
from django.db import connection
from django.utils import timezone

from portal.core.redis.client import redis_keys
from tests.helpers.gateway import NO_FIRST_TOKEN_IN_TIME, chat_body

pytestmark = [pytest.mark.django_db(transaction=True)]


def post(gateway, setup, body, **kw):
    return httpx.post(
        f"{gateway.url}/v1/chat/completions", headers=setup.headers, json=body, timeout=30, **kw
    )


def flushed_usage(setup):
    from portal.teams.models import Usage
    from portal.teams.services import usage_flush

    usage_flush()
    return list(Usage.objects.filter(team=setup.team).order_by("created_at"))


@pytest.mark.slow  # out of make test-fast: seconds of work on 2 cores
def test_it_records_exactly_one_usage_row_per_request_whatever_the_outcome(gateway, serving, gw_redis):
    post(gateway, serving, chat_body(serving.model, stream=True, max_tokens=7)).read()
    post(gateway, serving, chat_body(serving.model, max_tokens=5))
    post(gateway, serving, chat_body(serving.model, bogus=1))
    post(gateway, serving, chat_body(serving.model, "FAKE status=500"))
    post(gateway, serving, chat_body(serving.model, "FAKE die_after=2", stream=True))
    post(gateway, serving, chat_body(serving.model, NO_FIRST_TOKEN_IN_TIME, stream=True))
    rows = flushed_usage(serving)
    assert [(r.status, r.http_status) for r in rows] == [
        ("completed", 200),
        ("completed", 200),
        ("rejected", 400),
        ("upstream_error", 502),
        ("upstream_error", 502),
        ("timeout", 504),
    ]
    streamed, plain = rows[0], rows[1]
    assert (streamed.completion_tokens, plain.completion_tokens) == (7, 5)
    assert streamed.prompt_tokens > 0 and streamed.ttft_ms > 0 and streamed.duration_ms >= streamed.ttft_ms
    assert streamed.stream and not plain.stream
    # A non-streamed answer arrives whole: no time to first token (end-to-end latency only).
    assert plain.ttft_ms is None and plain.duration_ms > 0
    assert {r.api_key_id for r in rows} == {serving.key.pk}
    assert rows[0].deployment_id == serving.deployment.pk
    # Flushing again writes nothing twice.
    assert len(flushed_usage(serving)) == 6


def test_it_stamps_the_keys_last_use(gateway, serving, gw_redis):
    post(gateway, serving, chat_body(serving.model))
    flushed_usage(serving)
    serving.key.refresh_from_db()
    assert serving.key.last_used_at is not None


def test_it_corrects_the_token_reservation_to_actual_use(gateway, serving, gw_redis):
    serving.team.tokens_per_day = 100_000
    serving.team.save()
    post(gateway, serving, chat_body(serving.model, max_tokens=1000))  # reserves > 1000; uses ~1000 fewer
    rows = flushed_usage(serving)
    used = rows[0].prompt_tokens + rows[0].completion_tokens
    day = int(timezone.now().timestamp() // 86400)
    assert int(gw_redis.get(redis_keys().tpd_prefix("team", serving.team.pk) + str(day))) == used


def test_it_refuses_a_revoked_key_at_once_even_while_cached_and_says_revoked(gateway, serving, gw_redis):
    from portal.teams.services import api_key_revoke

    assert post(gateway, serving, chat_body(serving.model)).status_code == 200  # the key row is now cached
    api_key_revoke(api_key=serving.key)
    response = post(gateway, serving, chat_body(serving.model))
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "revoked_api_key"
    assert "revoked" in response.json()["error"]["message"]


def test_models_refuses_a_revoked_key_at_once_even_while_cached_and_says_revoked(gateway, serving, gw_redis):
    """docs/teams.md: revocation takes effect at the next request; /v1/models answered for GATEWAY_CACHE_S."""
    from portal.teams.services import api_key_revoke

    url = f"{gateway.url}/v1/models"
    assert httpx.get(url, headers=serving.headers).status_code == 200  # the key row is now cached
    api_key_revoke(api_key=serving.key)
    response = httpx.get(url, headers=serving.headers)
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "revoked_api_key"


def test_it_refuses_an_expired_key(gateway, serving, gw_redis):
    from portal.teams.models import ApiKey

    ApiKey.objects.filter(pk=serving.key.pk).update(expires_at=timezone.now() - dt.timedelta(seconds=1))
    response = post(gateway, serving, chat_body(serving.model))
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "expired_api_key"


def test_it_lists_only_the_models_the_key_may_use(gateway, team, cpu_node, fake_upstream, serving, gw_redis):
    from tests.helpers.gateway import make_setup

    other = make_setup(team=team, node=cpu_node, upstream=fake_upstream)
    response = httpx.get(f"{gateway.url}/v1/models", headers=serving.headers)
    ids = [m["id"] for m in response.json()["data"]]
    assert serving.model in ids and other.model not in ids


def test_it_never_writes_a_keys_secret_to_a_log_or_a_database_column(gateway, serving, gw_redis):
    secret = serving.token.split(".", 1)[1]
    post(gateway, serving, chat_body(serving.model, stream=True)).read()
    post(gateway, serving, chat_body(serving.model, bogus=1))
    post(gateway, serving, chat_body(serving.model, "FAKE status=500"))
    httpx.post(
        f"{gateway.url}/v1/chat/completions", headers={"Authorization": f"Bearer {serving.token}x"}, json={}
    )
    httpx.get(f"{gateway.url}/v1/models", headers=serving.headers)
    flushed_usage(serving)

    log = gateway.log_text()
    assert "POST /v1/chat/completions" in log  # the log is the one we think it is
    assert secret not in log

    with connection.cursor() as cursor:
        for table in connection.introspection.table_names(cursor):
            cursor.execute(f'SELECT * FROM "{table}"')  # noqa: S608 (table names come from the catalog)
            for row in cursor.fetchall():
                assert secret not in repr(row), f"the secret is stored in {table}"


def test_the_official_openai_client_works_through_the_gateway(gateway, serving, gw_redis):
    from openai import OpenAI

    client = OpenAI(base_url=f"{gateway.url}/v1", api_key=serving.token)
    reply = client.chat.completions.create(
        model=serving.model, messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    assert reply.choices[0].message.content == "tok tok tok "
    stream = client.chat.completions.create(
        model=serving.model, messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True
    )
    pieces = [c.choices[0].delta.content for c in stream if c.choices and c.choices[0].delta.content]
    assert pieces == ["tok "] * 4
    assert [m.id for m in client.models.list()] == [serving.model]
