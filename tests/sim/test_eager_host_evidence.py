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
