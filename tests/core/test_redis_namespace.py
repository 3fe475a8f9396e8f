"""Two installations sharing one Redis: each reads and writes only its own namespace."""

from __future__ import annotations

import time

import pytest
import redis
from django.conf import settings

from portal.celery import app
from portal.core.redis.client import redis_keys
from portal.core.redis.keys import RedisKeys
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


@pytest.mark.parametrize(
    "urls",
    [
        ["postgres://portal@db:5432/portal", "postgres://portal@db/portal", "postgresql://portal@DB./portal"],
        ["postgres://portal@localhost/portal", "postgres://portal@127.0.0.1:5432/portal"],
    ],
)
def test_a_derived_namespace_does_not_depend_on_how_the_database_url_is_spelled(urls):
    import environ

    from portal.core.redis.keys import namespace_for_database

    assert len({namespace_for_database(environ.Env.db_url_config(url)) for url in urls}) == 1


@pytest.fixture
def heartbeats():
    from portal.core.heartbeat import database_fingerprint
    from portal.core.redis.keys import heartbeat_key

    client = redis.Redis.from_url(settings.GATEWAY_REDIS_URL)
    key = heartbeat_key(database_fingerprint())
    client.delete(key)
    yield client
    client.delete(key)
    client.close()


def test_a_worker_on_another_namespace_of_the_same_database_is_shown_on_the_dashboard(
    heartbeats, alice, tmp_path, caplog
):
    """Two namespaces live for one database (a worker configured a little differently): the worker
    logs it, and the ops dashboard says so; one namespace alone shows nothing."""
    from django.test import Client

    from portal.core.heartbeat import live_namespaces, namespace_heartbeat_record
    from tests.helpers.agents import node_agent

    ours = settings.PORTAL_REDIS_NAMESPACE
    # Ends as ours does: under xdist, tests/settings.py appends the worker id to a namespace that does not.
    theirs = f"other-{ours}"
    assert namespace_heartbeat_record(kind="web") == []
    staff = Client()
    staff.force_login(alice)
    assert b"namespace-split" not in staff.get("/").content
    log_path = tmp_path / "worker.log"
    with node_agent("namespace-probe", log_path, PORTAL_REDIS_NAMESPACE=theirs):
        deadline = time.monotonic() + 60
        while not any(b.namespace == theirs and b.kind == "worker" for b in live_namespaces() or []):
            assert time.monotonic() < deadline, log_path.read_text()[-2000:]
            time.sleep(0.2)
        # The worker writes its beat to Redis before it logs what the beat found: wait for the line.
        while "Redis namespace mismatch" not in log_path.read_text():
            assert time.monotonic() < deadline, log_path.read_text()[-2000:]
            time.sleep(0.2)
    page = staff.get("/").content.decode()
    assert 'id="namespace-split"' in page
    assert f"<code>{theirs}</code>" in page and f"<code>{ours}</code>" in page
    with caplog.at_level("WARNING", logger="portal.core"):
        assert namespace_heartbeat_record(kind="web") == [theirs]
    assert "Redis namespace mismatch" in caplog.text
