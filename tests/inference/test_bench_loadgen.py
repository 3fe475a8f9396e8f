"""The load generator against the deterministic fake server (in-process, real HTTP on localhost)."""

from __future__ import annotations

import asyncio
import contextlib
import threading

import pytest
from aiohttp import web

from devtools import free_port
from inference.errors import InputError
from inference.loadgen.fake_server import FakeServer
from inference.loadgen.loadgen import BenchConfig, LevelPlan, NoHooks, judge_client, run_blocking, run_sweep
from inference.loadgen.workloads import load_mix


async def sweep_against(server: FakeServer, **config) -> tuple:
    runner = web.AppRunner(server.app(), access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        hooks = config.pop("hooks", None)
        defaults = {
            "base_url": f"http://127.0.0.1:{port}",
            "model": server.model,
            "mix": load_mix("fixed:32:8"),
        }
        return await run_sweep(BenchConfig(**(defaults | config)), hooks), server
    finally:
        await runner.cleanup()


def run(server: FakeServer, **config):
    return run_blocking(sweep_against(server, **config))[0]


def test_it_measures_the_known_delays_of_a_closed_loop():
    result = run(
        FakeServer(first_token_s=0.05, token_interval_s=0.01), levels=[LevelPlan(concurrency=4, requests=24)]
    )
    (level,) = result.levels
    assert level["completed"] == 24 and level["failed"] == 0
    assert level["warmup_requests"] == 4
    # The server cannot be early; how late it is depends on this machine's load (the
    # comparison script measures that), so only loose upper bounds here.
    assert 50 <= level["mean_ttft_ms"] < 500
    assert 8 <= level["mean_tpot_ms"] < 50
    assert level["total_output_tokens"] == 24 * 8
    assert level["little_law"]["ok"] is True
    assert level["partial"] is False


def test_it_runs_an_open_loop_level_at_a_poisson_rate():
    result = run(
        FakeServer(first_token_s=0.02, token_interval_s=0.005),
        levels=[LevelPlan(request_rate=40, requests=30)],
    )
    (level,) = result.levels
    assert level["mode"] == "open" and level["concurrency"] is None
    assert level["completed"] == 30
    assert level["little_law"]["concurrency_used"] > 0


def test_it_runs_a_level_for_a_duration():
    result = run(
        FakeServer(first_token_s=0.01, token_interval_s=0.002),
        levels=[LevelPlan(concurrency=2, duration_s=0.5)],
    )
    (level,) = result.levels
    assert level["completed"] >= 10
    # Users dispatch for 0.5 s; the span runs from the first measured start to the last end, and a
    # user's last end is stamped just before the check that finds the deadline passed, so the span
    # can fall short of 0.5 s by that moment (CI: 0.49996 s), longer if the process is preempted there.
    assert 0.45 <= level["duration"] < 2.0


def test_it_reads_the_servers_metrics_around_a_level():
    result = run(FakeServer(), levels=[LevelPlan(concurrency=4, requests=8)])
    (level,) = result.levels
    # 8 measured + 4 warm-up requests of 8 tokens each were generated during the level.
    assert level["server_generation_tokens"] == 12 * 8
    assert level["preemptions"] == 0
    assert level["running_peak"] is not None
    assert level["client_cpu_share"] is not None and level["loop_lag_p95_ms"] is not None


def test_it_takes_output_tokens_from_usage_with_multi_token_chunks():
    result = run(
        FakeServer(token_interval_s=0.01, chunk_tokens=4), levels=[LevelPlan(concurrency=1, requests=3)]
    )
    (level,) = result.levels
    assert level["total_output_tokens"] == 3 * 8
    # Chunks of 4 tokens arrive 40 ms apart: ITL sees the chunks, TPOT the tokens.
    assert 30 < level["mean_itl_ms"] < 200
    assert level["mean_tpot_ms"] == pytest.approx(level["mean_itl_ms"] / 7)  # 2 chunks of 4: 1 gap, 7 steps


def test_it_counts_failed_requests_with_their_reason_and_keeps_the_rest():
    result = run(
        FakeServer(fail_every=3), calibrate=False, levels=[LevelPlan(concurrency=2, requests=12, warmup=0)]
    )
    (level,) = result.levels
    assert level["failed"] == 4 and level["completed"] == 8
    assert level["errors"] == {"HTTP 500 InternalServerError: injected failure": 4}
    assert level["mean_ttft_ms"] > 0


def test_it_says_clearly_when_the_endpoint_is_unreachable():
    config = BenchConfig(
        base_url=f"http://127.0.0.1:{free_port()}",
        model="m",
        mix=load_mix("fixed:8:2"),
        levels=[LevelPlan(concurrency=1, requests=1)],
    )
    with pytest.raises(InputError) as caught:
        run_blocking(run_sweep(config))
    assert caught.value.field == "url"
    assert "cannot reach" in str(caught.value)


def test_it_names_the_served_models_when_the_model_is_wrong():
    with pytest.raises(InputError) as caught:
        run(FakeServer(model="tiny"), model="llama", levels=[LevelPlan(concurrency=1, requests=1)])
    assert caught.value.field == "model"
    assert "it serves: tiny" in str(caught.value)


@pytest.mark.slow  # waits out a real timeout or a simulated acceptance
def test_it_marks_a_level_that_times_out_as_partial_and_keeps_what_finished():
    result = run(
        FakeServer(first_token_s=0.01, token_interval_s=0.05),
        mix=load_mix("fixed:8:10"),
        # 0.5 s a request, two at a time: a few finish in 3 s even on a loaded machine, 40 cannot.
        level_timeout_s=3,
        levels=[LevelPlan(concurrency=2, requests=40, warmup=0), LevelPlan(concurrency=1, requests=1)],
    )
    first = result.levels[0]
    assert first["partial"] is True
    assert first["partial_reason"] == "level timeout after 3 s"
    assert first["completed"] >= 2
    assert first["failed"] >= 1
    assert any(reason.startswith("unfinished: level timeout") for reason in first["errors"])
    assert len(result.levels) == 2  # a timed-out level does not stop the sweep
    assert "level 1 stopped early" in result.error


class CancelAfterFirstLevel(NoHooks):
    def __init__(self) -> None:
        self.flag = threading.Event()
        self.finished: list[int] = []

    def level_finished(self, index: int, level: dict) -> None:
        self.finished.append(index)

    def progress(self, index: int, done: int, planned: int | None) -> None:
        if index == 1 and done >= 2:
            self.flag.set()

    def cancelled(self) -> bool:
        return self.flag.is_set()


def test_it_stops_when_cancelled_and_keeps_finished_levels():
    hooks = CancelAfterFirstLevel()
    result = run(
        FakeServer(first_token_s=0.01, token_interval_s=0.01),
        hooks=hooks,
        levels=[
            LevelPlan(concurrency=1, requests=2),
            LevelPlan(concurrency=1, requests=200),
            LevelPlan(concurrency=1, requests=2),
        ],
    )
    assert result.cancelled is True
    assert hooks.finished == [0, 1]
    assert result.levels[0]["partial"] is False
    assert result.levels[1]["partial_reason"] == "cancelled"


def test_it_refuses_a_tokenizer_that_cannot_load(tmp_path):
    broken = tmp_path / "tokenizer.json"
    broken.write_text("{not json")
    with pytest.raises(InputError) as caught:
        run(FakeServer(), tokenizer=str(tmp_path), levels=[LevelPlan(concurrency=1, requests=1)])
    assert caught.value.field == "tokenizer"
    assert "cannot load tokenizer" in str(caught.value)


def test_it_refuses_a_level_with_neither_count_nor_duration():
    with pytest.raises(InputError, match="request count or a duration"):
        LevelPlan(concurrency=4)
    with contextlib.suppress(InputError):
        LevelPlan(concurrency=4, requests=1)


def test_it_calls_a_saturated_client_the_bottleneck():
    assert judge_client(0.95, 2.0) == ("load generator CPU 95 % of a core", "")
    assert judge_client(0.6, 25.0)[0] == "event-loop lag P95 25.0 ms"


def test_it_blames_a_busy_host_not_an_idle_client_for_lag():
    reason, note = judge_client(0.05, 147.0)
    assert reason == ""
    assert note.startswith("event-loop lag P95 147 ms while the load generator used 5 % of a core")
    assert judge_client(0.2, 3.0) == ("", "")


def test_it_runs_a_sweep_from_a_thread_that_already_runs_an_event_loop():
    async def inside_a_loop():
        return run(FakeServer(), levels=[LevelPlan(concurrency=1, requests=2)])

    # On a thread of its own: this test's thread may already run Playwright's loop.
    outcome = []
    thread = threading.Thread(target=lambda: outcome.append(asyncio.run(inside_a_loop())))
    thread.start()
    thread.join()
    assert outcome[0].levels[0]["completed"] == 2


def test_it_retries_the_calibration_request_on_a_flaky_server():
    # Every 2nd request fails: calibration (#1 ok) passes; a 1-in-1 failing server would not.
    result = run(FakeServer(fail_every=2), levels=[LevelPlan(concurrency=1, requests=4, warmup=0)])
    assert result.levels[0]["failed"] == 2


def test_it_gives_up_on_a_server_that_fails_every_request():
    with pytest.raises(InputError, match=r"calibration request failed: HTTP 500.*\(3 tries\)"):
        run(FakeServer(fail_every=1), levels=[LevelPlan(concurrency=1, requests=1)])
