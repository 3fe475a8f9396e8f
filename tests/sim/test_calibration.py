"""Fitting a node's host costs to measured levels, and the overlap of launch work with the GPU."""

from __future__ import annotations

from dataclasses import replace

import pytest

from inference.errors import InputError
from inference.hardware import get_gpu
from inference.hf_config import resolve_model_config
from inference.loadgen.workloads import load_mix
from inference.planner import ProfileSettings
from inference.sim.calibration import fit_host_costs, measured_levels
from inference.sim.costs import DEFAULT_HOST_COSTS, BatchShape, HostCosts, ScheduledChunk, StepCostModel
from inference.sim.engine import EngineConfig
from inference.sim.virtual import sweep

LLAMA_7B = resolve_model_config("llama-2-7b-chat-hf")
H200 = get_gpu("h200-sxm-141gb")
# A short fixed workload keeps every fit to a few seconds.
MIX = load_mix("fixed:256:48")
# What a slow host in front of an H200 looks like (docs/simulator.md, "Calibration"):
# ~22 ms per eager 7B decode step, ~4.5 ms with CUDA graphs.
SLOW_HOST = HostCosts(
    step_overhead_s=1.0e-3,
    eager_launch_s_per_layer=640e-6,
    graph_launch_s_per_layer=20e-6,
    api_s_per_token=15e-6,
)


def config(*, eager: bool, host: HostCosts = DEFAULT_HOST_COSTS, model=LLAMA_7B) -> EngineConfig:
    profile = ProfileSettings(
        tensor_parallel_size=1, enforce_eager=eager, max_model_len=4096, dtype="float16"
    )
    return EngineConfig(model=model, profile=profile, gpu=H200, host=host)


def decode(batch: int, context: int = 600) -> BatchShape:
    return BatchShape.of([ScheduledChunk(context, 1, True)] * batch)


def by_level(result: dict) -> dict[int, dict]:
    return {level["concurrency"]: level for level in result["levels"]}


# --- the overlap ---------------------------------------------------------------------


def test_it_charges_an_eager_step_the_larger_of_launch_work_and_gpu_work_not_their_sum():
    costs = StepCostModel(LLAMA_7B, config(eager=True).profile, H200, host=SLOW_HOST)
    small, large = costs.batch_time(decode(1)), costs.batch_time(decode(256, context=1500))

    # One user: the CPU launching 32 layers (and streaming one token) bounds the step; the
    # GPU's 3-4 ms hide under it.
    assert small.total_s == pytest.approx(SLOW_HOST.step_overhead_s + 32 * 640e-6 + 15e-6)
    # 256 users: the GPU's work bounds it, the launches hide under it.
    assert large.gpu_s > 32 * 640e-6
    assert large.total_s == pytest.approx(SLOW_HOST.step_overhead_s + large.gpu_s + large.launch_gap_s)


def test_it_explains_eager_five_times_slower_than_graphs_at_one_user_and_close_at_256():
    eager = StepCostModel(LLAMA_7B, config(eager=True).profile, H200, host=SLOW_HOST)
    graphs = StepCostModel(LLAMA_7B, config(eager=False).profile, H200, host=SLOW_HOST)

    one = eager.batch_time(decode(1)).total_s / graphs.batch_time(decode(1)).total_s
    many = eager.batch_time(decode(256, 1500)).total_s / graphs.batch_time(decode(256, 1500)).total_s

    assert 4 <= one <= 6
    assert many <= 1.06


def test_it_keeps_the_uncalibrated_step_as_it_was():
    # Before calibration: max(GPU, per-token work) + scheduling + 60 µs per layer, eager.
    step = StepCostModel(LLAMA_7B, config(eager=True).profile, H200).batch_time(decode(16))

    assert step.total_s == pytest.approx(step.gpu_s + 1.5e-3 + 32 * 60e-6)


# --- reading a bench report and a calibration ---------------------------------------------


def test_it_reads_the_closed_loop_levels_of_a_bench_report():
    report = {
        "levels": [
            {"concurrency": 1, "completed": 10, "failed": 0, "output_throughput": 45.0, "mean_tpot_ms": 22.0},
            {"concurrency": None, "completed": 10, "output_throughput": 90.0, "mean_tpot_ms": 22.0},
            {"concurrency": 4, "completed": 0, "failed": 8, "output_throughput": None, "mean_tpot_ms": None},
        ]
    }

    [level] = measured_levels(report)

    assert (level.concurrency, level.output_throughput, level.mean_tpot_ms) == (1, 45.0, 22.0)
    assert level.requests == 10


def test_it_refuses_a_file_that_is_not_a_bench_report():
    with pytest.raises(InputError, match=r'^calibrate_from: is not a report of `manage.py bench --json`'):
        measured_levels({"calibration": {}})


def test_it_names_a_fit_level_the_report_lacks():
    report = {"levels": [{"concurrency": 1, "completed": 4, "output_throughput": 45.0, "mean_tpot_ms": 22.0}]}

    with pytest.raises(InputError, match=r"no measured level at concurrency 16"):
        measured_levels(report, only=[1, 16])


def test_it_reads_a_saved_calibration_and_keeps_defaults_for_missing_names():
    host = HostCosts.from_dict({"eager_launch_s_per_layer": 6e-4})

    assert host == replace(DEFAULT_HOST_COSTS, eager_launch_s_per_layer=6e-4)
    assert HostCosts.from_dict(host.as_dict()) == host


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"launch": 1e-4}, r"unknown names launch"),
        ({"step_overhead_s": -1e-3}, r"step_overhead_s must be between 0 and 0\.05 s"),
        ({"api_s_per_token": "10us"}, r"api_s_per_token must be a number of seconds"),
        ({"api_s_per_token": float("nan")}, r"api_s_per_token must be a number of seconds"),
        ([1, 2], r"must be an object"),
    ],
)
def test_it_refuses_a_calibration_it_cannot_apply(values, message):
    with pytest.raises(InputError, match=message) as caught:
        HostCosts.from_dict(values)
    assert caught.value.field == "calibration"


# --- fitting ---------------------------------------------------------------------------


@pytest.mark.slow  # out of make test-fast: seconds of work on 2 cores
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_it_fits_two_low_levels_and_predicts_the_higher_ones(eager):
    # Measurements made by the simulator itself with a slow host's constants: the fit must
    # find constants that reproduce levels it never saw.
    truth = sweep(config(eager=eager, host=SLOW_HOST), MIX, [1, 4, 16, 64], requests_per_level=64)

    fit = fit_host_costs(config(eager=eager), MIX, measured_levels(truth, only=[1, 4]))

    predicted = by_level(sweep(config(eager=eager, host=fit.host), MIX, [16, 64], requests_per_level=64))
    for level in (16, 64):
        measured = by_level(truth)[level]
        assert predicted[level]["output_throughput"] == pytest.approx(measured["output_throughput"], rel=0.05)
        assert predicted[level]["mean_tpot_ms"] == pytest.approx(measured["mean_tpot_ms"], rel=0.05)
    launch = "eager_launch_s_per_layer" if eager else "graph_launch_s_per_layer"
    assert set(fit.fitted) == {"step_overhead_s", launch, "api_s_per_token"}


@pytest.mark.slow  # out of make test-fast: seconds of work on 2 cores
def test_it_leaves_the_constants_a_run_does_not_exercise_alone():
    truth = sweep(config(eager=True, host=SLOW_HOST), MIX, [1, 4], requests_per_level=32)

    fit = fit_host_costs(config(eager=True), MIX, measured_levels(truth))

    assert fit.host.graph_launch_s_per_layer == DEFAULT_HOST_COSTS.graph_launch_s_per_layer
    # The eager launch work is what a slow host shows, not the scheduling (the ridge).
    assert fit.host.eager_launch_s_per_layer == pytest.approx(640e-6, rel=0.15)
    assert fit.host.step_overhead_s < 3e-3
