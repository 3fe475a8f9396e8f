"""Two installations sharing one Redis: each reads and writes only its own namespace."""

from __future__ import annotations

import time

import pytest
import redis
from django.conf import settings

from inference.redis_keys import RedisKeys
from portal.celery import app
from portal.core.redis_client import redis_keys
from portal.observability import prometheus
from portal.observability.selectors import traffic_last_hour

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("gateway_redis_db")]

THEIRS = RedisKeys("another-portal")


@pytest.fixture
def shared_redis():
    client = redis.Redis.from_url(settings.GATEWAY_REDIS_URL)
    yield client
    stale = [*client.scan_iter(f"{THEIRS.namespace}:*"), *client.scan_iter(f"{redis_keys().metrics}*")]
    if stale:
        client.delete(*stale)
    client.close()


def test_celery_queues_live_under_the_namespace(shared_redis):
    broker = redis.Redis.from_url(settings.CELERY_BROKER_URL)
    queue = "namespace-probe"
    raw = redis_keys().celery_key(queue)
    try:
        app.send_task("portal.teams.tasks.usage_flush", queue=queue)
        assert broker.llen(raw) == 1 and raw.startswith(f"{settings.PORTAL_REDIS_NAMESPACE}:")
        assert not broker.exists(queue)  # an installation with another namespace never sees it
    finally:
        broker.delete(raw, queue)
        broker.close()


def test_the_dashboard_shows_only_this_installations_traffic(shared_redis):
    now = time.time()
    minute = int(now // 60)
    shared_redis.hset(THEIRS.metrics_minute(minute), mapping={"requests": 10_000, "rejected": 7_418})
    assert traffic_last_hour(now=now)[-1].requests == 0
    prometheus.gateway_request_ended(endpoint="chat", model="m", status="completed", http_status=200, at=now)
    assert prometheus.recorder.flush()
    assert traffic_last_hour(now=now)[-1].requests == 1
