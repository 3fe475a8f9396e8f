"""One rule for the client's address (portal/core/clientaddr.py), used by the login throttle, the
gateway's failed-key throttle and the audit log: the peer, unless TRUSTED_PROXY_COUNT proxies
stand in front, and then the entry the outermost of them appended to X-Forwarded-For."""

from __future__ import annotations

import pytest
import redis
from django.conf import settings as django_settings
from django.test import Client, RequestFactory

from portal.audit.models import AuditEvent
from portal.core.clientaddr import client_address
from portal.core.redis.client import redis_keys

PROXY = "10.1.0.1"


def request_from(peer: str, forwarded: str | None = None):
    extra = {"HTTP_X_FORWARDED_FOR": forwarded} if forwarded is not None else {}
    return RequestFactory().get("/", REMOTE_ADDR=peer, **extra)


@pytest.mark.parametrize(
    ("count", "forwarded", "expected"),
    [
        (0, None, PROXY),
        (0, "192.0.2.1", PROXY),  # nobody is trusted to say: whatever a client writes is ignored
        (1, "198.51.100.7", "198.51.100.7"),
        (1, "192.0.2.1, 198.51.100.7", "198.51.100.7"),  # the client's own entry is left of the proxy's
        (2, "192.0.2.1, 198.51.100.7, 10.1.0.2", "198.51.100.7"),
        (2, "198.51.100.7", PROXY),  # fewer entries than proxies: it did not come through them all
        (1, "not-an-address", PROXY),
    ],
)
def test_it_takes_the_peer_unless_trusted_proxies_say_otherwise(settings, count, forwarded, expected):
    settings.TRUSTED_PROXY_COUNT = count
    assert client_address(request_from(PROXY, forwarded)) == expected


@pytest.mark.django_db
def test_the_audit_log_records_the_address_the_trusted_proxy_saw(settings, alice, team):
    settings.TRUSTED_PROXY_COUNT = 1
    client = Client(REMOTE_ADDR=PROXY, HTTP_X_FORWARDED_FOR="192.0.2.9, 198.51.100.7")
    client.force_login(alice)
    response = client.patch(f"/api/v1/teams/{team.slug}/", {"gpu_quota": 4}, content_type="application/json")
    assert response.status_code == 200, response.content
    event = AuditEvent.objects.get(action="team.quotas_change")
    assert event.ip == "198.51.100.7"


@pytest.mark.django_db
@pytest.mark.usefixtures("gateway_redis_db")
def test_the_gateway_counts_a_wrong_key_against_the_address_the_trusted_proxy_saw(settings):
    settings.TRUSTED_PROXY_COUNT = 1
    client = redis.Redis.from_url(django_settings.GATEWAY_REDIS_URL)
    counted = redis_keys().auth_failures("198.51.100.7")
    client.delete(counted)
    try:
        response = Client(REMOTE_ADDR=PROXY, HTTP_X_FORWARDED_FOR="192.0.2.9, 198.51.100.7").post(
            "/v1/chat/completions", {"model": "m"}, content_type="application/json",
            HTTP_AUTHORIZATION="Bearer not-a-key",  # refused before any database read
        )  # fmt: skip
        assert response.status_code == 401
        assert client.exists(counted)
        assert not client.exists(redis_keys().auth_failures(PROXY))
    finally:
        client.delete(counted)
        client.close()
