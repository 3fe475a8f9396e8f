"""A batch's life around its lines: expiry, cancel before running, staff's pause, run windows, and
the dispatcher that resumes what no runner holds. The runner runs here, in the test's process."""

from __future__ import annotations

import datetime as dt

import pytest
from django.core.management import call_command
from django.utils import timezone

from portal.batches.lifecycle import batch_validate, batches_dispatch
from portal.batches.models import Batch, BatchLine, BatchStatus, LineState, WaitReason
from portal.batches.runner import batch_run
from portal.batches.selectors import batches_paused
from portal.batches.services import batch_cancel, batch_create, file_create, file_read
from tests.helpers import builders
from tests.helpers.batches import SIM_MODEL, empty_batch_queue, input_lines, jsonl, read_jsonl

pytestmark = [pytest.mark.django_db(transaction=True)]


@pytest.fixture
def sends(monkeypatch):
    """Each batch task sent, with the batch's lease (owner, expiry) as the commit that sent it left it."""
    from portal.celery import app

    sent: list[tuple[str, tuple[str, object]]] = []

    def record(name, args, **_options):
        sent.append((name, Batch.objects.values_list("lease_owner", "lease_expires_at").get(pk=args[0])))

    monkeypatch.setattr(app, "send_task", record)
    return sent


@pytest.fixture
def started(team, gw_redis):
    """A validated batch of 4 lines, in progress, that no runner has started."""
    empty_batch_queue()
    key = builders.api_key(team, models=[SIM_MODEL])[0]
    file = file_create(team=team, filename="in.jsonl", content=jsonl(input_lines(4)), purpose="batch")
    batch = batch_create(
        team=team,
        api_key=key,
        input_file_id=file.public_id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    batch_validate(batch_id=batch.pk)
    batch.refresh_from_db()
    assert batch.status == BatchStatus.IN_PROGRESS
    return batch


def test_the_validation_lets_go_of_the_batch_in_the_commit_that_sends_its_run(sends, started):
    """A runner that takes the run message at once finds the batch free, not still held by the
    validation that sent it (it would return "not runnable here" and wait for the dispatcher)."""
    assert [(name, lease) for name, lease in sends if name == "batches.run"] == [("batches.run", ("", None))]


def test_a_batch_past_its_window_expires_with_its_unsent_lines_in_the_error_file(started):
    Batch.objects.filter(pk=started.pk).update(expires_at=timezone.now() - dt.timedelta(seconds=1))
    assert batch_run(batch_id=started.pk) == "expired"
    started.refresh_from_db()
    assert started.status == BatchStatus.EXPIRED and started.expired_at is not None
    assert (started.request_completed, started.request_failed) == (0, 4)
    errors = read_jsonl(file_read(file=started.error_file))
    assert sorted(line["custom_id"] for line in errors) == [f"req-{n}" for n in range(4)]
    assert {line["error"]["code"] for line in errors} == {"batch_expired"}
    assert started.output_file is None


def test_a_batch_cancelled_before_it_ran_ends_cancelled_without_files(started):
    batch_cancel(batch=started)
    assert batch_run(batch_id=started.pk) == "cancelled"
    started.refresh_from_db()
    assert started.status == BatchStatus.CANCELLED and started.cancelling_at and started.cancelled_at
    assert started.output_file is None and started.error_file is None
    assert set(BatchLine.objects.filter(batch=started).values_list("state", flat=True)) == {
        LineState.CANCELLED
    }
    assert batch_cancel(batch=started).status == BatchStatus.CANCELLED  # again: nothing changes


def test_staff_pause_stops_every_batch_until_resumed(started):
    call_command("batches", "pause")
    assert batches_paused()
    assert batch_run(batch_id=started.pk) == "waiting: paused"
    started.refresh_from_db()
    assert started.status == BatchStatus.IN_PROGRESS and started.wait_reason == WaitReason.PAUSED
    assert not BatchLine.objects.filter(batch=started).exclude(state=LineState.PENDING).exists()
    # The lease is given back: the dispatcher starts it again.
    assert started.lease_owner == "" and started.lease_expires_at is None
    call_command("batches", "resume")
    assert not batches_paused()


def test_a_team_outside_its_run_window_waits_for_it_to_open(started, team):
    now = timezone.localtime()
    opens = (now + dt.timedelta(hours=2)).strftime("%H:%M")
    closes = (now + dt.timedelta(hours=3)).strftime("%H:%M")
    team.batch_run_window = f"{opens}-{closes}"
    team.save()
    assert batch_run(batch_id=started.pk) == "waiting: run_window"
    started.refresh_from_db()
    assert started.wait_reason == WaitReason.RUN_WINDOW
    assert dt.timedelta(hours=1) < started.wait_until - timezone.now() < dt.timedelta(hours=2, minutes=1)


def test_the_dispatcher_resumes_a_batch_whose_runner_lease_lapsed_and_leaves_a_live_one(started):
    Batch.objects.filter(pk=started.pk).update(
        lease_token=7,
        lease_owner="host:1:runner",
        lease_expires_at=timezone.now() + dt.timedelta(minutes=1),
    )
    assert batches_dispatch() == {"validate": 0, "run": 0}
    Batch.objects.filter(pk=started.pk).update(lease_expires_at=timezone.now() - dt.timedelta(seconds=1))
    assert batches_dispatch() == {"validate": 0, "run": 1}
    assert batches_dispatch() == {"validate": 0, "run": 0}  # sent: not again while a worker may take it
    marked = Batch.objects.get(pk=started.pk)
    # The mark: the lapsed runner's token moved on (its next renewal is refused), no owner (a
    # runner may claim it at once), an expiry that keeps the dispatcher away for the grace.
    assert (marked.lease_token, marked.lease_owner) == (8, "")
    assert marked.lease_expires_at is not None and marked.lease_expires_at > timezone.now()
    Batch.objects.filter(pk=started.pk).update(
        lease_expires_at=None,
        wait_reason=WaitReason.DAILY_BUDGET,
        wait_until=timezone.now() + dt.timedelta(hours=1),
    )
    assert batches_dispatch() == {"validate": 0, "run": 0}  # its budget resets later: nothing to try


def test_a_batch_whose_runner_died_writing_its_files_is_finished_by_the_next(started):
    BatchLine.objects.filter(batch=started).update(
        state=LineState.SUCCEEDED, response_status=200, response_body={"choices": []}
    )
    Batch.objects.filter(pk=started.pk).update(
        status=BatchStatus.FINALIZING,
        lease_token=1,
        lease_owner="host:1:dead-runner",
        lease_expires_at=timezone.now() - dt.timedelta(seconds=1),
    )
    assert batches_dispatch()["run"] == 1
    assert batch_run(batch_id=started.pk) == "finalizing"
    started.refresh_from_db()
    assert started.status == BatchStatus.COMPLETED and started.request_completed == 4
    assert len(read_jsonl(file_read(file=started.output_file))) == 4


def test_a_runner_whose_lease_was_taken_over_writes_nothing_on_the_batch_or_its_lines(started):
    from portal.batches.runner import RUNNABLE, _claim, _set_wait, _store, _tick, finish, lease_take

    first = lease_take(batch_id=started.pk, statuses=RUNNABLE)
    assert first is not None and lease_take(batch_id=started.pk, statuses=RUNNABLE) is None  # held
    claimed = _claim(started.pk, first.token, 2)
    assert [line.claim_token for line in claimed] == [first.token, first.token]
    Batch.objects.filter(pk=started.pk).update(lease_expires_at=timezone.now() - dt.timedelta(seconds=1))
    second = lease_take(batch_id=started.pk, statuses=RUNNABLE)
    assert second is not None and second.token == first.token + 1
    # The first runner's lines are pending again, and nothing it writes is kept.
    assert set(BatchLine.objects.filter(batch=started).values_list("state", flat=True)) == {LineState.PENDING}
    assert _tick(first).lost
    _set_wait(first, WaitReason.PAUSED, None)
    assert not _store(started, claimed[0], first.token, None, {"code": "x", "message": "x"})
    assert not finish(lease=first, end="cancelled")
    started.refresh_from_db()
    assert (started.status, started.wait_reason, started.request_failed) == (BatchStatus.IN_PROGRESS, "", 0)
    assert started.lease_token == second.token and started.lease_owner == second.owner
    assert not first.release()
    assert second.release()


def test_progress_estimates_the_finish_at_the_rate_of_the_last_minutes(started):
    from portal.batches.selectors import batch_progress

    now = timezone.now()
    first, second = BatchLine.objects.filter(batch=started).order_by("line_number")[:2]
    BatchLine.objects.filter(pk__in=[first.pk, second.pk]).update(state=LineState.SUCCEEDED, finished_at=now)
    progress = batch_progress(batch=started, now=now)
    assert (progress.done, progress.total, progress.percent) == (2, 4, 50.0)
    assert progress.lines_per_s == pytest.approx(2 / 300)
    assert progress.eta == now + dt.timedelta(seconds=300)  # 2 left at 2 per 5 minutes


def test_the_portals_run_window_holds_a_team_without_its_own(started, settings):
    now = timezone.localtime()
    opens, closes = now + dt.timedelta(hours=1), now + dt.timedelta(hours=2)
    settings.BATCH_RUN_WINDOW = f"{opens:%H:%M}-{closes:%H:%M}"
    assert batch_run(batch_id=started.pk) == "waiting: run_window"


@pytest.mark.parametrize(
    ("window", "time", "inside"),
    [
        ("20:00-07:00", "23:30", True),
        ("20:00-07:00", "06:59", True),
        ("20:00-07:00", "07:00", False),
        ("20:00-07:00", "12:00", False),
        ("09:00-17:00", "09:00", True),
        ("09:00-17:00", "17:00", False),
        ("00:00-00:00", "12:00", True),
    ],
)
def test_a_window_across_midnight_runs_from_its_start_to_its_end_the_next_morning(window, time, inside):
    from portal.batches.windows import within_window

    hour, minute = map(int, time.split(":"))
    moment = timezone.make_aware(dt.datetime(2026, 12, 4, hour, minute))
    assert within_window(window, moment) is inside
