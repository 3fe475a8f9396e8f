"""/metrics: the token, what it shows, how counts travel from processes to Redis, Celery outcomes."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from devtools import stop
from portal.observability import prometheus
from portal.observability.collector import read_counters
from tests.helpers import builders
from tests.helpers.metrics import TOKEN, scrape, value

pytestmark = pytest.mark.django_db
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def metrics_token(settings):
    settings.PORTAL_METRICS_TOKEN = TOKEN


def test_metrics_are_off_without_a_token_setting(client, settings):
    settings.PORTAL_METRICS_TOKEN = ""
    assert client.get("/metrics").status_code == 404
    assert client.get("/metrics", HTTP_AUTHORIZATION="Bearer ").status_code == 404


@pytest.mark.parametrize(
    "header",
    [None, "", "Bearer", "Bearer wrong-token", f"Basic {TOKEN}", f"Bearer {TOKEN}x", f"Bearer {TOKEN[:-1]}"],
)
def test_it_refuses_a_missing_or_wrong_token(client, header):
    extra = {} if header is None else {"HTTP_AUTHORIZATION": header}
    response = client.get("/metrics", **extra)
    assert response.status_code == 401
    assert response["WWW-Authenticate"] == 'Bearer realm="metrics"'
    assert b"portal_" not in response.content


def test_a_signed_in_staff_user_still_needs_the_token(client, alice):
    client.force_login(alice)
    assert client.get("/metrics").status_code == 401


def test_it_serves_deployments_by_state_in_prometheus_text(client, metrics_redis, team, llama7b, cpu_node):
    for name, state in [("a", "serving"), ("b", "serving"), ("c", "failed")]:
        builders.deployment(name=name, team=team, model_version=llama7b, node=cpu_node, state=state)
    response = client.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}")
    assert response["Content-Type"].startswith("text/plain; version=")
    assert response["Cache-Control"].startswith("max-age=0")
    samples = scrape(client)
    assert value(samples, "portal_deployments", state="serving") == 2
    assert value(samples, "portal_deployments", state="failed") == 1
    assert ("portal_deployments", (("state", "stopped"),)) in samples  # every state, zeros included
    assert value(samples, "portal_metrics_redis_up") == 1


def test_a_request_lands_in_the_right_histogram_buckets(client, metrics_redis):
    prometheus.gateway_request_ended(
        endpoint="chat", model="m", status="completed", http_status=200, duration_s=0.3, ttft_s=0.05
    )
    assert prometheus.recorder.flush()
    samples = scrape(client)
    bucket = "portal_gateway_request_duration_seconds_bucket"
    assert value(samples, bucket, model="m", le="0.25") == 0
    assert value(samples, bucket, model="m", le="0.5") == 1
    assert value(samples, bucket, model="m", le="+Inf") == 1
    assert value(samples, "portal_gateway_request_duration_seconds_sum", model="m") == pytest.approx(0.3)
    assert value(samples, "portal_gateway_ttft_seconds_bucket", model="m", le="0.05") == 1  # le is inclusive
    assert value(samples, "portal_gateway_ttft_seconds_bucket", model="m", le="0.025") == 0


def test_a_client_cannot_mint_a_series_with_an_unknown_model_name(client, metrics_redis):
    for i in range(3):
        prometheus.gateway_request_ended(
            endpoint="chat", model=f"no-such-model-{i}", status="rejected", http_status=404,
            error_code="model_not_found",
        )  # fmt: skip
    assert prometheus.recorder.flush()
    samples = scrape(client)
    assert value(samples, "portal_gateway_requests_total", model="", endpoint="chat", status="rejected",
                 code="404") == 3  # fmt: skip
    assert not any("no-such-model" in str(key) for key in samples)


def test_counts_survive_a_redis_outage_and_land_once(client, metrics_redis, settings):
    good = settings.GATEWAY_REDIS_URL
    key = (prometheus.REQUESTS, "m", "completions", "completed", "200")
    settings.GATEWAY_REDIS_URL = "redis://127.0.0.1:1/0"  # nothing listens there: a real refused connection
    prometheus.gateway_request_ended(endpoint="completions", model="m", status="completed", http_status=200)
    assert prometheus.recorder.flush() is False
    response = client.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}")
    assert b"portal_metrics_redis_up 0.0" in response.content  # the scrape still answers
    prometheus.gateway_request_ended(endpoint="completions", model="m", status="completed", http_status=200)
    settings.GATEWAY_REDIS_URL = good
    assert key not in read_counters(metrics_redis)
    assert prometheus.recorder.flush() is True
    assert read_counters(metrics_redis)[key] == 2
    assert prometheus.recorder.flush() is True  # nothing left to send twice
    assert read_counters(metrics_redis)[key] == 2


def _flush_in_child(queue) -> None:
    queue.put(prometheus.recorder.flush())


def test_a_forked_child_does_not_send_its_parents_counts_again(metrics_redis):
    prometheus.gateway_request_ended(endpoint="chat", model="fork", status="completed", http_status=200)
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_flush_in_child, args=(queue,))
    child.start()
    child.join(30)
    assert queue.get(timeout=5) is True  # flushed nothing (or its copy would count again below)
    assert prometheus.recorder.flush()
    assert read_counters(metrics_redis)[(prometheus.REQUESTS, "fork", "chat", "completed", "200")] == 1


# --- Celery task outcomes, from a real worker ---------------------------------------------


@pytest.fixture
def worker(settings):
    """A real Celery worker (solo pool) on a queue of its own, with the test tasks imported."""
    queue = f"metrics-test-{os.getpid()}"
    env = dict(
        os.environ,
        DJANGO_SETTINGS_MODULE="tests.settings",
        CELERY_BROKER_URL=settings.CELERY_BROKER_URL,
        CELERY_RESULT_BACKEND=settings.CELERY_RESULT_BACKEND,
        GATEWAY_REDIS_URL=settings.GATEWAY_REDIS_URL,
    )
    log_path = REPO / "test-artifacts" / "metrics-celery-worker.log"
    log_path.parent.mkdir(exist_ok=True)
    argv = [sys.executable, "-m", "celery", "-A", "portal", "worker", "-Q", queue, "--pool=solo",
            "--include", "tests.observability.celery_tasks", "--without-heartbeat", "--without-mingle",
            "--without-gossip", "--loglevel=INFO", "-n", f"metrics-test-{os.getpid()}@%h"]  # fmt: skip
    process = subprocess.Popen(
        argv, cwd=REPO, env=env, stdout=log_path.open("wb"), stderr=subprocess.STDOUT, start_new_session=True
    )
    yield queue, log_path
    stop(process, grace_s=30)


@pytest.mark.timeout(180)
def test_it_counts_celery_task_outcomes_from_a_real_worker(client, metrics_redis, worker):
    from portal.celery import app

    queue, log_path = worker
    for name in ("metrics_test.ok", "metrics_test.ok", "metrics_test.boom", "metrics_test.flaky"):
        app.send_task(name, queue=queue)
    expected = {
        ("metrics_test.ok", "succeeded"): 2,
        ("metrics_test.boom", "failed"): 1,
        ("metrics_test.flaky", "retried"): 1,
        ("metrics_test.flaky", "succeeded"): 1,
    }
    deadline = time.monotonic() + 120
    while True:
        samples = scrape(client)
        seen = {
            key: value(samples, "portal_celery_tasks_total", task=key[0], outcome=key[1]) for key in expected
        }
        if seen == expected or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert seen == expected, log_path.read_text()[-3000:]
    assert value(samples, "portal_celery_tasks_total", task="metrics_test.boom", outcome="succeeded") == 0


def test_the_beat_schedule_samples_queues_with_a_registered_task():
    from django.conf import settings

    from portal.celery import app

    app.loader.import_default_modules()
    entry = settings.CELERY_BEAT_SCHEDULE["observability-sample-queues"]
    assert entry["task"] in app.tasks
    assert entry["options"]["queue"] == "control"
