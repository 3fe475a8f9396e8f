"""Batches through faults, with real parts: a Celery worker on the batches queue, the simulator as
the upstream, Redis and workers killed for real. Nothing lost, nothing twice: every line that ran
is in the output or error file once, with one usage row (tests/helpers/batches.py)."""

from __future__ import annotations

import datetime as dt
import os
import signal

import pytest
from django.utils import timezone

from devtools import stop, wait_until
from portal.batches.lifecycle import batch_validate, batches_dispatch
from portal.batches.models import Batch, BatchLine, BatchStatus, LineState, WaitReason
from portal.batches.services import batch_cancel
from portal.celery import app
from tests.helpers.batches import (
    BATCH_QUEUE,
    assert_each_line_once,
    create_batch,
    empty_batch_queue,
    input_lines,
    line_states,
    serve_sim,
    start_batch_worker,
    start_sim,
    usage_of,
)

pytestmark = [pytest.mark.faults, pytest.mark.django_db(transaction=True)]

CONCURRENCY = 4


@pytest.fixture
def sim():
    url, process = start_sim(speedup=2.0)  # a line takes a few tenths of a second: there is a "mid"
    yield url
    stop(process)


@pytest.fixture
def workers(tmp_path):
    """Start batch workers (killed or stopped at the end); their logs in one file."""
    empty_batch_queue()
    log = tmp_path / "workers.log"
    started = []

    def start(**env: str):
        worker = start_batch_worker(log, BATCH_CONCURRENCY=str(CONCURRENCY), **env)
        started.append(worker)
        return worker

    start.log = log
    yield start
    for worker in started:
        if worker.poll() is None:
            stop(worker)
    empty_batch_queue()


def done_lines(batch) -> int:
    return BatchLine.objects.filter(
        batch_id=batch.pk, state__in=[LineState.SUCCEEDED, LineState.FAILED]
    ).count()


def ended(batch, *, dispatch: bool = False):
    def check():
        if dispatch:
            batches_dispatch()  # what beat does every BATCH_DISPATCH_INTERVAL_S
        batch.refresh_from_db()
        return batch.status in {"completed", "failed", "expired", "cancelled"}

    return check


@pytest.mark.timeout(300)
def test_a_batch_worker_sigkilled_mid_batch_resumes_on_a_new_worker_with_no_line_lost_or_twice(
    gw_redis, team, cpu_node, sim, workers
):
    setup = serve_sim(team=team, node=cpu_node, upstream=sim)
    first = workers()
    batch = create_batch(setup.team, setup.key, input_lines(40, max_tokens=24))
    wait_until(
        lambda: done_lines(batch) >= 8, timeout_s=120, what=f"lines done\n{workers.log.read_text()[-3000:]}"
    )
    os.killpg(first.pid, signal.SIGKILL)  # the worker and its pool process, lines in flight
    first.wait(timeout=10)
    at_kill = line_states(batch)
    assert at_kill.get(LineState.PENDING, 0) > 0, at_kill  # killed mid-batch, not after
    workers()
    wait_until(
        ended(batch, dispatch=True),
        timeout_s=240,
        interval_s=0.5,
        what=f"ended\n{workers.log.read_text()[-3000:]}",
    )
    assert batch.status == BatchStatus.COMPLETED, batch.errors
    written = assert_each_line_once(batch)
    assert len(written) == 40 and batch.request_completed == 40
    assert usage_of(batch.public_id).count() == 40


@pytest.mark.timeout(300)
def test_a_cancel_mid_batch_stops_dispatching_lets_lines_in_flight_finish_and_writes_partial_files(
    gw_redis, team, cpu_node, sim, workers
):
    setup = serve_sim(team=team, node=cpu_node, upstream=sim)
    workers()
    batch = create_batch(setup.team, setup.key, input_lines(60, max_tokens=24))
    wait_until(
        lambda: done_lines(batch) >= 6, timeout_s=120, what=f"lines done\n{workers.log.read_text()[-3000:]}"
    )
    cancelled = batch_cancel(batch=Batch.objects.get(pk=batch.pk))
    at_cancel = done_lines(batch)
    assert cancelled.status == BatchStatus.CANCELLING
    wait_until(ended(batch), timeout_s=120, what=f"cancelled\n{workers.log.read_text()[-3000:]}")
    assert batch.status == BatchStatus.CANCELLED
    states = line_states(batch)
    assert LineState.RUNNING not in states and LineState.PENDING not in states, states
    # Only the lines already in flight ran after the cancel.
    assert at_cancel <= done_lines(batch) <= at_cancel + CONCURRENCY
    assert states[LineState.CANCELLED] >= 60 - at_cancel - CONCURRENCY
    written = assert_each_line_once(batch)
    assert len(written) == done_lines(batch) and batch.output_file is not None


@pytest.mark.timeout(300)
def test_a_daily_budget_spent_mid_batch_waits_for_the_next_day_then_finishes_each_line_once(
    gw_redis, team, cpu_node, sim, workers
):
    setup = serve_sim(team=team, node=cpu_node, upstream=sim, key_fields={"tokens_per_day": 600})
    workers()
    batch = create_batch(setup.team, setup.key, input_lines(40, max_tokens=16))

    def waiting():
        batch.refresh_from_db()
        return batch.wait_reason == WaitReason.DAILY_BUDGET and batch.lease_owner == ""

    wait_until(waiting, timeout_s=120, what=f"waiting for the budget\n{workers.log.read_text()[-3000:]}")
    assert batch.status == BatchStatus.IN_PROGRESS
    tomorrow = (timezone.now() + dt.timedelta(days=1)).astimezone(dt.UTC).date()
    assert batch.wait_until == dt.datetime.combine(tomorrow, dt.time(), tzinfo=dt.UTC)
    states = line_states(batch)
    assert 0 < states[LineState.SUCCEEDED] < 40 and LineState.FAILED not in states, states
    assert usage_of(batch.public_id).count() == states[LineState.SUCCEEDED]
    assert batches_dispatch()["run"] == 0  # nothing is tried before the budget resets
    # The next day: a fresh budget (the day's counter starts again; here, the quota is lifted).
    setup.key.tokens_per_day = None
    setup.key.save()
    Batch.objects.filter(pk=batch.pk).update(wait_until=timezone.now() - dt.timedelta(seconds=1))
    wait_until(
        ended(batch, dispatch=True),
        timeout_s=180,
        interval_s=0.5,
        what=f"ended\n{workers.log.read_text()[-3000:]}",
    )
    assert batch.status == BatchStatus.COMPLETED and batch.wait_reason == ""
    assert len(assert_each_line_once(batch)) == 40


@pytest.mark.timeout(300)
def test_a_redis_restart_mid_batch_loses_no_line_and_runs_none_twice(
    transactional_db, team, cpu_node, sim, workers, private_redis
):
    setup = serve_sim(team=team, node=cpu_node, upstream=sim)
    url = private_redis.url
    workers(REDIS_URL=url, GATEWAY_REDIS_URL=url, CELERY_BROKER_URL=url, CELERY_RESULT_BACKEND=url)
    batch = create_batch(setup.team, setup.key, input_lines(40, max_tokens=24))
    batch_validate(batch_id=batch.pk)  # here: the worker's broker is the private Redis, not the test's
    with app.connection_for_write(url) as connection:
        app.send_task("batches.run", args=[batch.pk], queue=BATCH_QUEUE, connection=connection)
    wait_until(
        lambda: done_lines(batch) >= 8, timeout_s=120, what=f"lines done\n{workers.log.read_text()[-3000:]}"
    )
    private_redis.kill(signal.SIGKILL)  # every key lost: slots, counters, the broker's queues
    assert line_states(batch).get(LineState.PENDING, 0) > 0
    private_redis.start()
    wait_until(ended(batch), timeout_s=240, interval_s=0.5, what=f"ended\n{workers.log.read_text()[-3000:]}")
    assert batch.status == BatchStatus.COMPLETED, batch.errors
    assert len(assert_each_line_once(batch)) == 40
