"""What the recorded H200 runs say about eager mode's host cost (issue 24, item 4).

Each recorded level's median inter-token gap is a decode step; the simulated GPU part of that step
is taken off (`perf/sim_twin_errors.py --decode-steps`). These tests pin the readings that chose the
model in docs/simulator.md ("Why the held-out eager levels miss"): the host overlaps the GPU's work
(the simulator's max(host, GPU)), its launch work per layer does not depend on the layer's shape,
and the held-out 14B's eager steps took ~30 % more host time per layer than the 7B's acceptance
levels on the same node, which no shape-based term fitted on the 7B can give.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from inference.hardware import get_gpu
from perf.sim_twin_errors import decode_step_evidence, load_report

DATA = Path(__file__).parent / "data" / "h200"
H200 = get_gpu("h200-sxm-141gb")


def steps(name: str) -> dict[int, dict]:
    return {row["users"]: row for row in decode_step_evidence(load_report(DATA / f"{name}.json"), H200)}


def test_the_simulated_gpu_part_is_the_whole_cuda_graph_decode_step():
    # With CUDA graphs the host hides under the GPU: what the step leaves beyond the simulated
    # GPU part and the scheduling is within ±20 µs a layer at every recorded level, so the eager
    # residual below is host time, not a GPU the simulator gets wrong.
    for name in (
        "bench-llama-2-7b-chat-hf-graphs",
        "bench-mistral-7b-instruct-v0.3-graphs",
        "accept-llama-2-7b-chat-hf-short-qa-graphs",
        "heldout-qwen2.5-14b-instruct-chat-mixed-graphs",
    ):
        for users, row in steps(name).items():
            assert abs(row["serial_us_per_layer"]) < 20, (name, users)


@pytest.mark.parametrize("users", [16, 64])
def test_mha_and_gqa_shapes_take_the_same_host_time_per_layer_when_it_overlaps_the_gpu(users):
    # Llama-2-7B (MHA, MLP 11008) and Mistral-7B (GQA, MLP 14336) on one VM, same layer count and
    # kernels: read as overlapped they agree (700 vs 747, 901 vs 879 µs); read as in series with the
    # GPU they do not (444 vs 551, 373 vs 615), because Llama's GPU part is 1.3-2× Mistral's.
    llama = steps("bench-llama-2-7b-chat-hf-eager")[users]
    mistral = steps("bench-mistral-7b-instruct-v0.3-eager")[users]

    overlapped = mistral["overlapped_us_per_layer"] / llama["overlapped_us_per_layer"]
    serial = mistral["serial_us_per_layer"] / llama["serial_us_per_layer"]

    assert 0.9 <= overlapped <= 1.1
    assert serial >= 1.2


def test_the_held_out_14b_took_more_host_time_per_layer_than_the_7b_acceptance_on_its_node():
    # The miss that remains (docs/simulator.md): at 8 users the 14B's eager step implies 679 µs of
    # host work per layer, the 7B's acceptance level at 16 users 526 µs (1.29×), though the 14B has
    # half the sequences. A plain-PyTorch layer of each shape on an H200 VM of the same kind took
    # the same launch time (14B / 7B median 1.06, p10-p90 0.90-1.26) while the VM's host speed
    # swung by up to 2× within a minute.
    held_out = steps("heldout-qwen2.5-14b-instruct-chat-mixed-eager")[8]
    acceptance = steps("accept-llama-2-7b-chat-hf-short-qa-eager")[16]

    assert held_out["overlapped_us_per_layer"] / acceptance["overlapped_us_per_layer"] > 1.25


LAYERS = Path(__file__).parent / "data" / "h200-layers"


@pytest.mark.slow  # one calibration fit over recorded levels (~10 s here)
def test_a_fit_on_the_32_layer_7b_carries_to_its_8_layer_cut_at_one_user():
    # Issue 40: on one VM the eager step was layers × ~0.7 ms whatever the shape. Fitted on the
    # full 7B's 1- and 32-user levels, the low-load term charged per step (as before issue 40)
    # put the 8-layer cut's 1-user TPOT at +97 %; charged per layer it lands within the target.
    from inference.loadgen.workloads import load_mix
    from inference.sim.calibration import fit_host_costs, measured_levels, simulate_levels
    from inference.sim.engine import EngineConfig
    from perf.sim_twin_errors import model_of

    full = load_report(LAYERS / "layers-llama-2-7b-chat-hf-eager.json")
    cut = load_report(LAYERS / "layers-llama-2-7b-chat-hf-L8-eager.json")
    mix = load_mix(full["report"]["mix"])
    levels = measured_levels(full["report"], only=[1, 32])
    fit = fit_host_costs(EngineConfig(model_of(full), full["profile"], H200), mix, levels)
    one_user = measured_levels(cut["report"], only=[1])
    cut_config = EngineConfig(model_of(cut), cut["profile"], H200, host=fit.host)
    predicted = simulate_levels(cut_config, mix, one_user)

    assert predicted[0]["mean_tpot_ms"] == pytest.approx(one_user[0].mean_tpot_ms, rel=0.20)
