"""The calibrated twin against real H200 runs (tests/sim/data/h200): fit two low levels, predict the rest.

Targets (issue 14): calibrated from the two lowest levels of the 7B llama-shaped model, the higher levels
within ±15 % on output tok/s and ±20 % on mean TPOT, in eager and CUDA-graph mode; the same calibration
on the GQA-shaped model (Mistral-7B) within the same bounds at every level. Issue 24 adds mean TTFT
within ±25 % at every level of both models (before it, TTFT was 33-63 % low at the low levels).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from inference.loadgen.workloads import load_mix
from inference.sim.calibration import fit_host_costs, measured_levels, simulate_levels
from inference.sim.costs import DEFAULT_HOST_COSTS
from inference.sim.engine import EngineConfig
from tests.helpers.sim import recorded_config

pytestmark = pytest.mark.slow  # calibration fits over recorded runs: out of make test-fast

DATA = Path(__file__).parent / "data" / "h200"
LLAMA, MISTRAL = "llama-2-7b-chat-hf", "mistral-7b-instruct-v0.3"
MIX = load_mix("field-mix")


def config(model: str, mode: str, host=DEFAULT_HOST_COSTS) -> EngineConfig:
    return recorded_config(model, mode, "h200-sxm-141gb", host)


def measured(model: str, mode: str):
    report = json.loads((DATA / f"bench-{model}-{mode}.json").read_text())
    return sorted(measured_levels(report), key=lambda level: level.concurrency)


MODES = ("eager", "graphs")


@pytest.fixture(scope="module")
def calibrations() -> dict:
    """Per mode, fitted on the llama-shaped model's two lowest levels (1 and 16 users) only."""
    return {mode: fit_host_costs(config(LLAMA, mode), MIX, measured(LLAMA, mode)[:2]).host for mode in MODES}


def predicted_vs_measured(model: str, mode: str, host, concurrency: int) -> tuple[dict, object]:
    [level] = [level for level in measured(model, mode) if level.concurrency == concurrency]
    # Simulated with as many requests and warm-ups as were measured (at most 4 per user, so
    # every recorded level runs whole).
    assert level.requests <= 4 * concurrency
    [result] = simulate_levels(config(model, mode, host), MIX, [level], seed=0)
    return result, level


def assert_within_targets(result: dict, level) -> None:
    assert result["output_throughput"] == pytest.approx(level.output_throughput, rel=0.15)
    assert result["mean_tpot_ms"] == pytest.approx(level.mean_tpot_ms, rel=0.20)
    assert result["mean_ttft_ms"] == pytest.approx(level.mean_ttft_ms, rel=0.25)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("concurrency", [1, 16, 64, 256])
def test_it_predicts_the_higher_levels_from_two_low_ones(calibrations, mode, concurrency):
    result, level = predicted_vs_measured(LLAMA, mode, calibrations[mode], concurrency)

    assert_within_targets(result, level)


# Mistral's eager 1-user level (3 requests, 24.8 ms per token, slower than its own 16-user level)
# was a strict xfail at +17 % tok/s before issue 24. With the TTFT terms and the output lag the
# eager fit explains llama's 1-user level differently and this level comes out at +13 %: it passes.
@pytest.mark.parametrize(("mode", "concurrency"), [(m, c) for m in MODES for c in (1, 16, 64, 256)])
def test_it_carries_the_calibration_to_a_gqa_model(calibrations, mode, concurrency):
    result, level = predicted_vs_measured(MISTRAL, mode, calibrations[mode], concurrency)

    assert_within_targets(result, level)


def test_it_fits_the_api_servers_per_request_work_and_a_prefill_rate_near_the_compute_estimate(
    calibrations,
):
    # The low levels' TTFT gap (33-63 % before issue 24) is mostly the API server's work per
    # request, ~10-25 ms on this VM; prefill runs near the model's compute estimate (the spread
    # of TTFT over prompts of 438-2547 tokens says so).
    for mode in MODES:
        host = calibrations[mode]
        assert 5e-3 <= host.api_s_per_request <= 40e-3, mode
        factor = host.eager_prefill_factor if mode == "eager" else host.graph_prefill_factor
        assert 0.8 <= factor <= 1.4, mode


def test_it_fits_a_slow_hosts_eager_launches_and_keeps_the_gpu_physics(calibrations):
    eager, graphs = calibrations["eager"], calibrations["graphs"]

    # ~20 ms of CPU per eager 7B step on this VM: ~0.6 ms per layer, 10× the V100-era default.
    assert 400e-6 <= eager.eager_launch_s_per_layer <= 900e-6
    # With graphs the CPU hides under the GPU: the scheduling is what the 1-user TPOT shows.
    assert 0.5e-3 <= graphs.step_overhead_s <= 2e-3
    assert graphs.eager_launch_s_per_layer == DEFAULT_HOST_COSTS.eager_launch_s_per_layer


# --- issue 24's held-out runs: calibrated from node acceptance's levels, a model nobody tuned on ---
QWEN_14B = "qwen2.5-14b-instruct"


def report(name: str) -> dict:
    return json.loads((DATA / f"{name}.json").read_text())


@pytest.fixture(scope="module")
def acceptance_fits() -> dict:
    """Per mode, fitted on the 7B's acceptance levels (short-qa, 1 and 16 users) as acceptance does."""
    fits = {}
    for mode in MODES:
        accepted = report(f"accept-{LLAMA}-short-qa-{mode}")
        levels = measured_levels(accepted)
        fits[mode] = fit_host_costs(config(LLAMA, mode), load_mix(accepted["mix"]), levels)
    return fits


@pytest.fixture(scope="module")
def acceptance_calibrations(acceptance_fits) -> dict:
    return {mode: fit.host for mode, fit in acceptance_fits.items()}


EAGER_14B_LOW_LOAD = pytest.mark.xfail(
    strict=True,
    reason="the 14B's eager steps at 8 and 32 users are ~30 % longer than the 7B's acceptance levels "
    "on the same node predict (TPOT 33 / 42 ms against 26 / 30 ms; tok/s +27 / +40 %): its decode "
    "steps imply 679 µs of host work per layer against the 7B's 526, while a layer's launch work "
    "does not depend on its shape and that kind of VM's host speed drifted by 30-40 % within a "
    "minute (docs/simulator.md, 'Why the held-out eager levels miss'); graphs and 128 users hold",
)


@pytest.mark.parametrize(
    ("mode", "concurrency"),
    [("graphs", 8), ("graphs", 32), ("graphs", 128), ("eager", 128)]
    + [pytest.param("eager", c, marks=EAGER_14B_LOW_LOAD) for c in (8, 32)],
)
def test_it_predicts_a_14b_gqa_model_under_a_mixed_workload_from_a_7b_acceptance(
    acceptance_calibrations, mode, concurrency
):
    held_out = report(f"heldout-{QWEN_14B}-chat-mixed-{mode}")
    [level] = [lv for lv in measured_levels(held_out) if lv.concurrency == concurrency]

    [result] = simulate_levels(
        config(QWEN_14B, mode, acceptance_calibrations[mode]), load_mix(held_out["mix"]), [level]
    )

    assert_within_targets(result, level)


@pytest.mark.parametrize(("mode", "concurrency"), [(m, c) for m in MODES for c in (8, 32, 128)])
def test_the_twins_range_holds_the_held_out_14b_and_its_pessimistic_end_is_on_the_safe_side(
    acceptance_fits, mode, concurrency
):
    # Issue 40, item 3: where the point prediction misses (eager at 8 and 32 users, above), the range
    # the twin gives for that question (another depth, another workload, levels above the fitted 16)
    # holds the measurement, and the end the SLA cap reads is the pessimistic side of it.
    from inference.sim.confidence import Question, basis_of, judge, mix_means

    held_out = report(f"heldout-{QWEN_14B}-chat-mixed-{mode}")
    mix = load_mix(held_out["mix"])
    [level] = [lv for lv in measured_levels(held_out) if lv.concurrency == concurrency]
    fit = acceptance_fits[mode]
    accepted = report(f"accept-{LLAMA}-short-qa-{mode}")
    basis = basis_of(
        gpu="h200-sxm-141gb", eager=mode == "eager", layers=32, mix=load_mix(accepted["mix"]),
        fit_levels=fit.levels,
    )  # fmt: skip
    prompt, output = mix_means(mix)
    question = Question(
        gpu="h200-sxm-141gb", eager=mode == "eager", layers=48, mean_prompt_tokens=prompt,
        mean_output_tokens=output,
    )  # fmt: skip
    [result] = simulate_levels(config(QWEN_14B, mode, fit.host), mix, [level])

    ranges = judge(result, basis=basis, calibrated=True, question=question).ranges

    for metric, measured_value in (
        ("output_throughput", level.output_throughput),
        ("mean_tpot_ms", level.mean_tpot_ms),
        ("mean_ttft_ms", level.mean_ttft_ms),
    ):
        interval = ranges[metric]
        assert interval.low <= measured_value <= interval.high, (metric, interval, measured_value)
    assert ranges["output_throughput"].pessimistic <= level.output_throughput
    assert ranges["mean_tpot_ms"].pessimistic >= level.mean_tpot_ms
