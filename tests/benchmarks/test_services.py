"""Benchmark runs against the fake server: create, execute (the job's body), cancel, resume, import.

Runs that are executed here are staff runs, which go straight to the engine; a member's run goes
through the gateway (tests/benchmarks/test_gateway.py)."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone

from portal.benchmarks.models import BenchmarkLevel, BenchmarkRun, RunState
from portal.benchmarks.services import (
    FIELD_GUIDE_7B_TABLE,
    BenchmarkRunRequest,
    benchmark_import_table,
    benchmark_run_apply_sla_cap,
    benchmark_run_cancel,
    benchmark_run_create,
    benchmark_run_execute,
    parse_table,
    roofline_share,
)
from portal.core.errors import ApplicationError

pytestmark = pytest.mark.django_db


def create(user, deployment, **options):
    defaults = {"mix": "fixed:16:8", "concurrencies": [2, 4], "requests_per_level": 8}
    return benchmark_run_create(
        user=user, run_request=BenchmarkRunRequest(deployment=deployment, **(defaults | options))
    )


def test_it_snapshots_what_is_measured(bob, deployment):
    run = create(bob, deployment)
    assert run.state == RunState.QUEUED
    assert run.endpoint_url == deployment.endpoint_url
    assert run.model_name == "llama-2-7b-chat-hf"
    assert run.snapshot["profile"]["name"] == "v100-7b-fp16-tp8"
    assert run.snapshot["profile"]["tensor_parallel_size"] == 8
    assert run.snapshot["node"]["name"] == "dgx-v100-01"
    assert len(run.snapshot["gpus"]) == 8
    assert run.snapshot["roofline"]["bandwidth_gb_s"] == 900
    assert run.config["levels"][0] == {
        "concurrency": 2,
        "request_rate": None,
        "requests": 8,
        "duration_s": None,
        "warmup": None,
    }


def test_it_queues_the_job_on_the_benchmarks_queue_after_commit(
    bob, deployment, django_capture_on_commit_callbacks, monkeypatch
):
    sent = []
    # Sent by name (no service imports a tasks module); another task name records nothing.
    monkeypatch.setattr(
        "portal.celery.app.send_task",
        lambda name, args, queue: sent.append((args, queue)) if name == "benchmarks.run" else None,
    )
    with django_capture_on_commit_callbacks(execute=True):
        run = create(bob, deployment)
    assert sent == [([run.pk], "benchmarks")]


def test_it_routes_the_benchmark_task_to_its_own_queue_however_it_is_sent():
    from portal.celery import app

    assert app.amqp.router.route({}, "benchmarks.run")["queue"].name == "benchmarks"
    assert app.amqp.router.route({}, "deployments.supervise_all")["queue"].name == "control"


def test_it_refuses_a_deployment_that_is_not_serving(bob, deployment):
    deployment.state = "stopped"
    with pytest.raises(ApplicationError) as caught:
        create(bob, deployment)
    assert caught.value.field == "deployment"


def test_it_refuses_a_mix_whose_shares_do_not_add_up(bob, deployment):
    half, third = '{"share": 0.5, "prompt": 10, "output": 5}', '{"share": 0.3, "prompt": 10, "output": 5}'
    mix = f'{{"buckets": [{half}, {third}]}}'
    with pytest.raises(ApplicationError) as caught:
        create(bob, deployment, mix=mix)
    assert caught.value.field == "mix"
    assert "80 %" in caught.value.message


def test_it_reads_no_mix_file_even_for_staff(alice, deployment, tmp_path):
    mix = tmp_path / "mix.json"
    mix.write_text('{"buckets": [{"share": 1, "prompt": 10, "output": 5}]}')
    with pytest.raises(ApplicationError) as caught:
        create(alice, deployment, mix=str(mix))
    assert caught.value.field == "mix"
    assert "unknown mix" in caught.value.message


def test_it_runs_an_inline_json_mix_from_its_frozen_definition(alice, deployment):
    mix = '{"name": "tiny", "buckets": [{"share": 1, "prompt": 16, "output": [4, 8]}]}'
    run = create(alice, deployment, mix=mix)
    assert run.mix == "json:tiny"
    assert run.mix_definition["buckets"] == [{"share": 1.0, "prompt": [16, 16], "output": [4, 8]}]
    benchmark_run_execute(run_id=run.pk)
    run.refresh_from_db()
    assert run.state == RunState.DONE, run.state_reason
    for level in run.levels.all():
        assert 4 * 8 <= level.results["total_output_tokens"] <= 8 * 8  # 8 requests, 4–8 tokens each


def test_it_lets_only_staff_benchmark_a_bare_endpoint(bob, alice, fake_server):
    with pytest.raises(ApplicationError):
        benchmark_run_create(
            user=bob,
            run_request=BenchmarkRunRequest(endpoint_url=fake_server.url, model_name="x", concurrencies=[1]),
        )
    run = benchmark_run_create(
        user=alice,
        run_request=BenchmarkRunRequest(endpoint_url=fake_server.url, model_name="x", concurrencies=[1]),
    )
    assert run.deployment is None


def test_it_runs_every_level_and_picks_the_sla_point(alice, deployment):
    run = create(alice, deployment)
    benchmark_run_execute(run_id=run.pk)
    run.refresh_from_db()
    assert run.state == RunState.DONE, run.state_reason
    levels = list(run.levels.all())
    assert [level.concurrency for level in levels] == [2, 4]
    assert levels[0].results["completed"] == 8
    assert levels[0].results["mean_ttft_ms"] >= 20  # the fake server's first-token delay
    assert levels[0].samples["ttft_ms"]
    assert "samples" not in levels[0].results
    assert run.sla_concurrency == 4
    assert "4 is the highest level measured" in run.sla_reason
    assert run.progress["level"] == 1
    assert run.prompt_source.startswith("estimate")


def test_it_stores_the_roofline_share_of_each_level(alice, deployment):
    run = create(alice, deployment)
    benchmark_run_execute(run_id=run.pk)
    level = run.levels.first().results
    roofline = level["roofline"]
    assert roofline["share"] == pytest.approx(
        roofline["bytes_per_step_per_gpu"] / (level["mean_tpot_ms"] / 1000 * 900e9)
    )


def test_it_computes_the_roofline_share_from_the_planners_bytes():
    snapshot = {
        "roofline": {
            "weights_bytes_per_gpu": 1.7e9,
            "kv_bytes_per_token_per_gpu": 65536,
            "bandwidth_gb_s": 900,
        }
    }
    # 16 streams × (300 prompt + 200/2 output) tokens of KV per step: 0.42 GB; plus 1.7 GB of weights.
    level = {
        "concurrency": 16,
        "completed": 10,
        "total_input_tokens": 3000,
        "total_output_tokens": 2000,
        "mean_tpot_ms": 5.0,
    }
    share = roofline_share(level, snapshot)
    assert share["bytes_per_step_per_gpu"] == pytest.approx(1.7e9 + 65536 * 16 * 400)
    assert share["share"] == pytest.approx((1.7e9 + 65536 * 16 * 400) / (0.005 * 900e9))
    assert roofline_share(level, {}) is None


def test_it_keeps_failures_with_reasons_and_refuses_the_level_for_the_sla(
    alice, team, llama7b, profile_tp8, dgx, fake_server_factory
):
    from tests.helpers.builders import make_serving_deployment

    flaky = fake_server_factory(fail_every=5)
    deployment = make_serving_deployment(
        team=team, model=llama7b, profile=profile_tp8, node=dgx, url=flaky.url
    )
    run = create(alice, deployment, concurrencies=[2])
    benchmark_run_execute(run_id=run.pk)
    run.refresh_from_db()
    level = run.levels.get()
    assert level.results["failed"] > 0
    assert any("injected failure" in reason for reason in level.results["errors"])
    assert run.sla_concurrency is None
    assert "failed request(s)" in run.sla_reason


def test_it_fails_with_a_clear_message_when_the_endpoint_is_unreachable(alice, deployment, fake_server):
    run = create(alice, deployment)
    fake_server.stop()
    benchmark_run_execute(run_id=run.pk)
    run.refresh_from_db()
    assert run.state == RunState.FAILED
    assert "cannot reach" in run.state_reason
    assert not run.levels.exists()


def test_it_marks_a_level_cut_by_its_timeout_as_partial(
    alice, team, llama7b, profile_tp8, dgx, fake_server_factory
):
    from tests.helpers.builders import make_serving_deployment

    slow = fake_server_factory(first_token_s=0.01, token_interval_s=0.05)
    deployment = make_serving_deployment(
        team=team, model=llama7b, profile=profile_tp8, node=dgx, url=slow.url
    )
    run = create(alice, deployment, concurrencies=[2], requests_per_level=50, level_timeout_s=1.5)
    benchmark_run_execute(run_id=run.pk)
    run.refresh_from_db()
    assert run.state == RunState.PARTIAL
    assert "level 1 stopped early: level timeout after 1.5 s" in run.state_reason
    level = run.levels.get()
    assert level.results["partial"] is True and level.results["completed"] > 0


def test_it_does_nothing_for_a_duplicate_delivery(bob, deployment):
    run = create(bob, deployment)
    BenchmarkRun.objects.filter(pk=run.pk).update(
        state=RunState.RUNNING, lease_expires_at=timezone.now() + timedelta(minutes=1)
    )
    benchmark_run_execute(run_id=run.pk)
    assert not run.levels.exists()


def test_it_resumes_after_the_last_saved_level_when_the_lease_expired(alice, deployment):
    run = create(alice, deployment)
    BenchmarkLevel.objects.create(
        run=run,
        index=0,
        concurrency=2,
        results={"concurrency": 2, "completed": 8, "failed": 0, "p95_ttft_ms": 1.0, "p95_tpot_ms": 1.0},
    )
    BenchmarkRun.objects.filter(pk=run.pk).update(
        state=RunState.RUNNING, lease_expires_at=timezone.now() - timedelta(seconds=1)
    )
    benchmark_run_execute(run_id=run.pk)
    run.refresh_from_db()
    assert run.state == RunState.DONE
    assert [level.concurrency for level in run.levels.all()] == [2, 4]
    assert run.levels.get(index=0).results["completed"] == 8  # untouched


def test_it_cancels_a_queued_run_at_once(bob, deployment):
    run = benchmark_run_cancel(run=create(bob, deployment))
    assert run.state == RunState.CANCELLED
    benchmark_run_execute(run_id=run.pk)
    assert not run.levels.exists()


def test_it_fails_a_running_run_whose_lease_lapsed(bob, deployment):
    from portal.benchmarks.services import benchmark_runs_expire

    run = create(bob, deployment)
    lapsed = timezone.now() - timedelta(seconds=1)
    BenchmarkRun.objects.filter(pk=run.pk).update(state=RunState.RUNNING, lease_expires_at=lapsed)
    assert benchmark_runs_expire() == [run.pk]
    run.refresh_from_db()
    assert run.state == RunState.FAILED and "lease" in run.state_reason and run.finished_at


def test_it_leaves_a_running_run_whose_lease_is_live_to_its_worker(bob, deployment):
    from portal.benchmarks.services import benchmark_runs_expire

    run = create(bob, deployment)
    live = timezone.now() + timedelta(seconds=60)
    BenchmarkRun.objects.filter(pk=run.pk).update(state=RunState.RUNNING, lease_expires_at=live)
    assert benchmark_runs_expire() == []
    assert BenchmarkRun.objects.get(pk=run.pk).state == RunState.RUNNING


def test_beat_ends_the_runs_whose_lease_lapsed_through_its_task(bob, deployment, settings):
    from portal.benchmarks.tasks import expire_runs

    run = create(bob, deployment)
    lapsed = timezone.now() - timedelta(seconds=1)
    BenchmarkRun.objects.filter(pk=run.pk).update(state=RunState.RUNNING, lease_expires_at=lapsed)
    assert expire_runs() == [run.pk]
    scheduled = {entry["task"] for entry in settings.CELERY_BEAT_SCHEDULE.values()}
    assert "benchmarks.expire_runs" in scheduled


def test_it_cancels_at_once_a_running_run_that_no_worker_holds(bob, deployment):
    run = create(bob, deployment)
    lapsed = timezone.now() - timedelta(seconds=1)
    BenchmarkRun.objects.filter(pk=run.pk).update(state=RunState.RUNNING, lease_expires_at=lapsed)
    run = benchmark_run_cancel(run=run)
    assert run.state == RunState.CANCELLED and run.finished_at


# Committed rows: the canceller thread has its own database connection.
@pytest.mark.django_db(transaction=True)
def test_it_stops_a_running_job_when_cancelled_and_keeps_finished_levels(
    alice, team, llama7b, profile_tp8, dgx, fake_server_factory
):
    from tests.helpers.builders import make_serving_deployment

    server = fake_server_factory(first_token_s=0.01, token_interval_s=0.01)
    deployment = make_serving_deployment(
        team=team, model=llama7b, profile=profile_tp8, node=dgx, url=server.url
    )
    run = create(alice, deployment, concurrencies=[1, 1, 1], requests_per_level=4, level_timeout_s=60)
    run.config["levels"][1]["requests"] = 1000
    run.save(update_fields=["config"])

    def cancel_when_level_two_runs() -> None:
        while server.server.received < 8:
            threading.Event().wait(0.05)
        BenchmarkRun.objects.filter(pk=run.pk).update(cancel_requested=True)
        connection.close()

    canceller = threading.Thread(target=cancel_when_level_two_runs)
    canceller.start()
    benchmark_run_execute(run_id=run.pk)
    canceller.join()
    run.refresh_from_db()
    assert run.state == RunState.CANCELLED
    levels = list(run.levels.all())
    assert len(levels) == 2
    assert levels[0].results["partial"] is False
    assert levels[1].results["partial_reason"] == "cancelled"


def test_it_applies_the_sla_point_as_the_gateway_cap_with_its_source(alice, bob, deployment):
    run = create(alice, deployment)
    benchmark_run_execute(run_id=run.pk)
    run.refresh_from_db()
    with pytest.raises(ApplicationError):
        benchmark_run_apply_sla_cap(run=run, user=bob)
    benchmark_run_apply_sla_cap(run=run, user=alice)
    deployment.refresh_from_db()
    assert deployment.concurrency_cap == 4
    assert f"benchmark run {run.pk}" in deployment.concurrency_cap_source
    assert "P95 TTFT ≤ 3 s and P95 TPOT ≤ 0.2 s" in deployment.concurrency_cap_source


def test_it_reads_the_field_notes_table():
    levels = parse_table(FIELD_GUIDE_7B_TABLE)
    assert levels[0] == {
        "failed": None,
        "concurrency": 16,
        "output_throughput": 1380.0,
        "mean_ttft_ms": 450.0,
        "p95_ttft_ms": 820.0,
        "mean_tpot_ms": 42.0,
        "p95_tpot_ms": 65.0,
    }


def test_it_imports_the_field_notes_table_and_shows_why_littles_law_fails(alice):
    run = benchmark_import_table(user=alice, title="7B", text=FIELD_GUIDE_7B_TABLE)
    assert run.sla_concurrency == 64
    assert "128 misses: P95 TTFT 3.20 s > 3 s" in run.sla_reason
    first = run.levels.get(index=0).results["little_law"]
    assert first["ok"] is False
    assert first["expected_output_throughput"] == pytest.approx(16 / 0.042)
    assert "can emit at most ~381 tok/s, yet 1380 tok/s is reported" in first["note"]
    assert all(level.results["little_law"]["ok"] is False for level in run.levels.all())


def test_it_imports_a_quoted_thousands_figure_of_a_csv_table_as_a_number(alice):
    text = 'concurrency,output tok/s,mean TPOT s\n16,"1,380",0.042\n32,"2,350",0.058\n'
    run = benchmark_import_table(user=alice, title="csv", text=text)
    first = run.levels.get(index=0).results
    assert first["concurrency"] == 16 and first["output_throughput"] == 1380
    assert first["mean_tpot_ms"] == pytest.approx(42.0)
    assert run.levels.get(index=1).results["output_throughput"] == 2350


@pytest.mark.parametrize(
    "text",
    [
        "| concurrency | output tok/s |\n|---|---|\n| 16 | 1,380 |",  # Markdown: a comma is the cell's
        "concurrency\toutput tok/s\n16\t1,380",  # a spreadsheet's tabs
        'concurrency, output tok/s\n16, "1,380"',  # CSV with a space after each comma
    ],
)
def test_it_reads_thousands_separators_in_each_dialect(text):
    assert parse_table(text) == [{"failed": None, "concurrency": 16, "output_throughput": 1380.0}]


def test_it_still_refuses_a_row_whose_cells_do_not_match_the_header():
    with pytest.raises(ApplicationError, match="row 2 has 3 cells, the header 2"):
        parse_table("concurrency,output tok/s\n16,1,380")


def test_it_refuses_a_table_without_concurrency(alice):
    with pytest.raises(ApplicationError, match="concurrency column"):
        benchmark_import_table(user=alice, title="x", text="| tok/s |\n|---|\n| 5 |")


def test_it_records_a_crash_of_the_job_instead_of_leaving_the_run_running(alice, deployment, monkeypatch):
    from portal.benchmarks.services import execution

    def explode(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(execution, "_save_level", explode)
    run = create(alice, deployment, concurrencies=[1], requests_per_level=2)
    with pytest.raises(RuntimeError):
        benchmark_run_execute(run_id=run.pk)
    run.refresh_from_db()
    assert run.state == RunState.FAILED
    assert run.state_reason == "the job crashed: RuntimeError: disk full"


def test_it_refuses_a_members_queued_run_once_the_member_left_the_team(bob, team, deployment):
    run = create(bob, deployment)
    team.members.remove(bob)
    benchmark_run_execute(run_id=run.pk)
    run.refresh_from_db()
    assert run.state == RunState.FAILED
    assert run.state_reason == "bob is no longer a member of Search: the run would spend its quota"
    assert not run.levels.exists() and deployment.team.api_keys.count() == 0


# Committed rows: the stalled worker runs on its own thread and database connection.
@pytest.mark.django_db(transaction=True)
def test_a_worker_stalled_past_its_lease_is_fenced_out_and_only_the_second_workers_levels_are_kept(
    alice, team, llama7b, profile_tp8, dgx, fake_server_factory, settings
):
    from tests.helpers.builders import make_serving_deployment
    from tests.helpers.jobs import StalledWorker

    settings.BENCHMARK_LEASE_S = 1
    server = fake_server_factory(first_token_s=0.01, token_interval_s=0.005)
    deployment = make_serving_deployment(
        team=team, model=llama7b, profile=profile_tp8, node=dgx, url=server.url
    )
    run = create(alice, deployment, concurrencies=[1, 2], requests_per_level=4)
    # The first worker measures level 0, then stalls just before saving it (a `fenced()` block).
    first = StalledWorker(
        "worker-a",
        lambda worker: benchmark_run_execute(run_id=run.pk, worker=worker),
        pause_when=lambda fields: not fields,
    )
    try:
        stalled = first.start_and_wait_stalled()
        # The message redelivered after the lease lapsed: a second worker takes the run over.
        assert benchmark_run_execute(run_id=run.pk, worker="worker-b") == RunState.DONE
        kept = BenchmarkRun.objects.get(pk=run.pk)
        kept_levels = {level.index: level.results for level in kept.levels.all()}
        first.resume()
    finally:
        first.close()

    assert first.error is None and first.result == "lease lost"
    run.refresh_from_db()
    assert (run.state, run.lease_token, run.lease_owner) == (RunState.DONE, stalled.token + 1, "")
    assert (run.progress, run.finished_at, run.state_reason) == (kept.progress, kept.finished_at, "")
    # Its level 0, measured and held across the stall, was refused: the second worker's stands.
    assert {level.index: level.results for level in run.levels.all()} == kept_levels
    assert sorted(kept_levels) == [0, 1]


@pytest.mark.django_db(transaction=True)
def test_a_worker_stalled_past_its_lease_writes_nothing_after_the_sweep_ended_its_run(
    alice, team, llama7b, profile_tp8, dgx, fake_server, settings
):
    from portal.benchmarks.services import benchmark_runs_expire
    from tests.helpers.builders import make_serving_deployment
    from tests.helpers.jobs import StalledWorker

    settings.BENCHMARK_LEASE_S = 1
    deployment = make_serving_deployment(
        team=team, model=llama7b, profile=profile_tp8, node=dgx, url=fake_server.url
    )
    run = create(alice, deployment, concurrencies=[1], requests_per_level=4)
    first = StalledWorker(
        "worker-a",
        lambda worker: benchmark_run_execute(run_id=run.pk, worker=worker),
        pause_when=lambda fields: not fields,  # its measured level, about to be saved
    )
    try:
        stalled = first.start_and_wait_stalled()
        assert benchmark_runs_expire() == [run.pk]
        first.resume()
    finally:
        first.close()

    assert first.error is None and first.result == "lease lost"
    run.refresh_from_db()
    assert run.state == RunState.FAILED and "lease" in run.state_reason
    assert run.lease_token == stalled.token + 1  # the sweep broke the lease
    assert not run.levels.exists()
