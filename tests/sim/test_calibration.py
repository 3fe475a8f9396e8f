"""Fitting a node's host costs to measured levels, and the overlap of launch work with the GPU."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from inference.errors import InputError
from inference.hardware import get_gpu
from inference.hf_config import resolve_model_config
from inference.loadgen.workloads import load_mix
from inference.profile import ProfileSettings
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
    with pytest.raises(InputError, match=r"^calibrate_from: is not a report of `manage.py bench --json`"):
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
    # Since issue 24 the fit also matches TTFT with the per-request API work; the prefill factor
    # is left alone on these short prompts (PREFILL_FIT_MIN_PROMPT_TOKENS).
    assert set(fit.fitted) == {"step_overhead_s", launch, "api_s_per_token", "api_s_per_request"}


@pytest.mark.slow  # out of make test-fast: seconds of work on 2 cores
def test_it_leaves_the_constants_a_run_does_not_exercise_alone():
    truth = sweep(config(eager=True, host=SLOW_HOST), MIX, [1, 4], requests_per_level=32)

    fit = fit_host_costs(config(eager=True), MIX, measured_levels(truth))

    assert fit.host.graph_launch_s_per_layer == DEFAULT_HOST_COSTS.graph_launch_s_per_layer
    # The eager launch work is what a slow host shows, not the scheduling (the ridge).
    assert fit.host.eager_launch_s_per_layer == pytest.approx(640e-6, rel=0.15)
    assert fit.host.step_overhead_s < 3e-3


# --- issue 24: TTFT, the output lag, the low-load term, old calibrations, the optimiser -------


def test_it_loads_a_calibration_saved_before_the_ttft_constants_and_predicts_as_before():
    # What `simulate --json` printed (and NodeAcceptance stored) before issue 24: four names.
    saved = {
        "step_overhead_s": 0.0014940,
        "eager_launch_s_per_layer": 0.0006237,
        "graph_launch_s_per_layer": 5.0e-06,
        "api_s_per_token": 3.2e-05,
    }

    host = HostCosts.from_dict(saved)

    assert host.api_s_per_request == 0.0
    assert (host.eager_prefill_factor, host.graph_prefill_factor) == (1.0, 1.0)
    assert host.eager_low_batch_s_per_step == 0.0
    # The new constants at their defaults change nothing a saved calibration predicted.
    costs = StepCostModel(LLAMA_7B, config(eager=True).profile, H200, host=host)
    prefill = BatchShape.of([ScheduledChunk(0, 1500, True), *[ScheduledChunk(600, 1, True)] * 3])
    gpu = max(costs.batch_time(prefill).compute_s, costs.batch_time(prefill).memory_s)
    assert costs.batch_time(prefill).total_s == pytest.approx(
        max(gpu + 32 * 60e-6, 32 * 0.0006237 + 4 * 3.2e-05) + 0.0014940
    )


def test_it_refuses_a_prefill_factor_outside_its_bounds_naming_it_a_ratio():
    with pytest.raises(InputError, match=r"graph_prefill_factor must be between 0\.25 and 10, got 20"):
        HostCosts.from_dict({"graph_prefill_factor": 20})


def test_it_charges_prompt_chunks_at_the_nodes_prefill_factor_and_leaves_decodes_alone():
    plain = StepCostModel(LLAMA_7B, config(eager=False).profile, H200)
    slow = StepCostModel(
        LLAMA_7B, config(eager=False).profile, H200, host=HostCosts(graph_prefill_factor=1.5)
    )
    prefill = BatchShape.of([ScheduledChunk(0, 2000, True)])

    expected = 1.5 * plain.batch_time(prefill).compute_s
    assert slow.batch_time(prefill).compute_s == pytest.approx(expected, rel=0.01)
    assert slow.batch_time(decode(64)).total_s == plain.batch_time(decode(64)).total_s


def test_it_hands_a_host_bound_steps_tokens_on_after_the_next_launch():
    eager = StepCostModel(LLAMA_7B, config(eager=True).profile, H200, host=SLOW_HOST)
    graphs = StepCostModel(LLAMA_7B, config(eager=False).profile, H200, host=SLOW_HOST)

    small = eager.batch_time(decode(1))
    # The CPU bounds the step: its tokens wait for the next step's launch work.
    assert small.output_lag_s == pytest.approx(small.host_overlapped_s)
    # With CUDA graphs the launch hides under the GPU: nothing waits.
    assert graphs.batch_time(decode(16)).output_lag_s == 0.0


def test_it_charges_the_eager_low_load_term_per_layer_so_it_carries_to_another_depth():
    # Issue 40: the host's extra time at one sequence is a slower launch of every layer
    # (tests/sim/data/h200-layers), so a model with a quarter of the layers pays a quarter of it.
    host = replace(SLOW_HOST, eager_low_batch_s_per_layer=100e-6)
    shallow_model = replace(LLAMA_7B, num_layers=8)
    deep = StepCostModel(LLAMA_7B, config(eager=True).profile, H200, host=host)
    shallow = StepCostModel(shallow_model, config(eager=True).profile, H200, host=host)
    deep_plain = StepCostModel(LLAMA_7B, config(eager=True).profile, H200, host=SLOW_HOST)
    shallow_plain = StepCostModel(shallow_model, config(eager=True).profile, H200, host=SLOW_HOST)

    deep_extra = deep.batch_time(decode(1)).total_s - deep_plain.batch_time(decode(1)).total_s
    shallow_extra = shallow.batch_time(decode(1)).total_s - shallow_plain.batch_time(decode(1)).total_s
    assert deep_extra == pytest.approx(32 * 100e-6)
    assert shallow_extra == pytest.approx(8 * 100e-6)
    assert deep.batch_time(decode(16)).total_s == deep_plain.batch_time(decode(16)).total_s


def test_it_charges_a_saved_per_step_low_load_term_in_full_at_one_sequence_and_not_at_sixteen():
    host = replace(SLOW_HOST, eager_low_batch_s_per_step=3e-3)
    with_term = StepCostModel(LLAMA_7B, config(eager=True).profile, H200, host=host)
    without = StepCostModel(LLAMA_7B, config(eager=True).profile, H200, host=SLOW_HOST)
    graphs = StepCostModel(LLAMA_7B, config(eager=False).profile, H200, host=host)

    one = without.batch_time(decode(1)).total_s
    assert with_term.batch_time(decode(1)).total_s == pytest.approx(one + 3e-3)
    assert with_term.batch_time(decode(16)).total_s == without.batch_time(decode(16)).total_s
    assert graphs.batch_time(decode(1)).overhead_s == host.step_overhead_s  # an eager-mode effect


def test_it_adds_the_api_servers_per_request_work_to_ttft_and_not_to_tpot():
    plain = by_level(sweep(config(eager=False), MIX, [1], requests_per_level=8))[1]
    api = by_level(
        sweep(config(eager=False, host=HostCosts(api_s_per_request=0.02)), MIX, [1], requests_per_level=8)
    )[1]

    assert api["mean_ttft_ms"] == pytest.approx(plain["mean_ttft_ms"] + 20, abs=0.5)
    assert api["mean_tpot_ms"] == pytest.approx(plain["mean_tpot_ms"])


def test_the_optimiser_finds_the_minimum_of_a_known_function_inside_its_box():
    from inference.sim.calibration import _nelder_mead

    def bowl(point: list[float]) -> float:  # minimum 0 at (1, -2, 0.5)
        x, y, z = point
        return (x - 1) ** 2 + 3 * (y + 2) ** 2 + 10 * (z - 0.5) ** 2 + 0.5 * (x - 1) * (y + 2)

    best = _nelder_mead(bowl, [0.0, 0.0, 0.0], [-5.0] * 3, [5.0] * 3)
    assert best == pytest.approx([1.0, -2.0, 0.5], abs=0.02)

    # A minimum outside the box: it stops at the bound, never past it.
    edge = _nelder_mead(bowl, [0.0, 0.0, 0.0], [-5.0, -1.0, -5.0], [5.0, 5.0, 5.0])
    assert edge[1] == pytest.approx(-1.0, abs=1e-9)
    assert min(edge[0], edge[2]) >= -5.0


# A mix whose prompts differ in length, so the TTFT's spread shows the prefill rate.
VARIED = load_mix('{"name": "varied", "buckets": [{"share": 1, "prompt": [100, 2500], "output": [40, 60]}]}')
SLOW_TTFT_HOST = replace(SLOW_HOST, api_s_per_request=15e-3, graph_prefill_factor=1.4)


@pytest.mark.slow  # out of make test-fast: tens of seconds on 2 cores
def test_it_fits_the_ttft_constants_on_two_low_levels_and_predicts_ttft_under_load():
    truth = sweep(config(eager=False, host=SLOW_TTFT_HOST), VARIED, [1, 8, 32, 64], requests_per_level=96)

    fit = fit_host_costs(config(eager=False), VARIED, measured_levels(truth, only=[1, 8]))

    assert {"api_s_per_request", "graph_prefill_factor"} <= set(fit.fitted)
    predicted = by_level(sweep(config(eager=False, host=fit.host), VARIED, [32, 64], requests_per_level=96))
    for level in (32, 64):
        measured = by_level(truth)[level]
        assert predicted[level]["mean_ttft_ms"] == pytest.approx(measured["mean_ttft_ms"], rel=0.15)
        assert predicted[level]["output_throughput"] == pytest.approx(measured["output_throughput"], rel=0.05)


@pytest.mark.slow  # out of make test-fast: tens of seconds on 2 cores
def test_it_fits_the_eager_low_load_effect_from_1_and_16_users_instead_of_averaging_it():
    # A node whose eager steps cost 4 ms more at one sequence (docs/simulator.md, "The low-load
    # host effect"): fitted on 1 and 16 users, the 1-user level gets its own term and the launch
    # work is what the 16-user level says, so 4 and 64 users come out right.
    host = replace(SLOW_HOST, eager_low_batch_s_per_layer=125e-6)  # 4 ms a step at 32 layers
    truth = sweep(config(eager=True, host=host), MIX, [1, 4, 16, 64], requests_per_level=64)

    fit = fit_host_costs(config(eager=True), MIX, measured_levels(truth, only=[1, 16]))

    assert "eager_low_batch_s_per_layer" in fit.fitted
    assert fit.host.eager_low_batch_s_per_layer == pytest.approx(125e-6, rel=0.25)
    assert fit.host.eager_launch_s_per_layer == pytest.approx(640e-6, rel=0.10)
    predicted = by_level(sweep(config(eager=True, host=fit.host), MIX, [4, 64], requests_per_level=64))
    # 64 users within 10 %: the per-token work, which 1 and 16 users barely show, is held to its
    # informed start (~2× this truth's 15 µs), and at 64 users it is a few per cent of a step.
    for level, tolerance in ((4, 0.05), (64, 0.10)):
        measured = by_level(truth)[level]
        for key in ("output_throughput", "mean_tpot_ms"):
            assert predicted[level][key] == pytest.approx(measured[key], rel=tolerance), (level, key)


def test_the_front_ends_serial_work_queues_requests_sent_together_and_only_them():
    # Issue 40: the API server does a request's serial work (template, tokenizing, hand-off) for one
    # request at a time, so four requests sent at once reach the engine 10 ms apart.
    from inference.sim.virtual import run_level

    specs = MIX.sample(4, seed=0)
    host = HostCosts(api_serial_s_per_request=10e-3)
    queued = run_level(config(eager=False, host=host), specs, concurrency=4).records
    alone = run_level(config(eager=False, host=host), specs[:1], concurrency=1).records
    plain = run_level(config(eager=False), specs[:1], concurrency=1).records

    first_tokens = sorted(record.token_times[0] - record.start for record in queued)
    gaps = [later - earlier for earlier, later in itertools.pairwise(first_tokens)]
    assert min(gaps) >= 9e-3
    # Alone, a request pays the work once and waits for nobody.
    alone_ttft = alone[0].token_times[0] - alone[0].start
    assert alone_ttft == pytest.approx(plain[0].token_times[0] - plain[0].start + 10e-3, abs=1e-4)


def test_a_fit_leaves_the_front_ends_serial_work_alone():
    # Two levels cannot tell it from the per-step scheduling (docs/simulator.md): fitted, it took
    # 6.5 ms on a node with none and pulled the launch work 19 % low.
    from inference.sim.calibration import fitted_names

    assert "api_serial_s_per_request" not in fitted_names(config(eager=True))
