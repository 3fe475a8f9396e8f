"""The step-cost model scales with what drives each cost, against docs/v100-field-guide.md's figures."""

from __future__ import annotations

import pytest

from inference.hardware import get_gpu
from inference.hf_config import resolve_model_config
from inference.planner import Sizing
from inference.profile import ProfileSettings
from inference.sim.costs import BatchShape, ScheduledChunk, StepCostModel

LLAMA_7B = resolve_model_config("llama-2-7b-chat-hf")
V100 = get_gpu("v100-sxm2-32gb")


def model(*, tp=8, eager=True, nvlink=True):
    profile = ProfileSettings(tensor_parallel_size=tp, enforce_eager=eager, max_model_len=4096)
    return StepCostModel(LLAMA_7B, profile, V100, nvlink=nvlink)


def decode(batch: int, context: int = 1500) -> BatchShape:
    return BatchShape.of([ScheduledChunk(context, 1, True)] * batch)


def test_it_reads_the_weight_shard_in_about_field_notes_time_at_batch_one():
    # docs/v100-field-guide.md#reference-arithmetic: 7B fp16 TP8 ≈ 1.75 GB per GPU, ≈ 2.3 ms at 750 GB/s.
    step = model().batch_time(decode(1, context=0))
    assert step.memory_s == pytest.approx(2.3e-3, rel=0.05)


def test_it_spends_about_field_notes_share_of_a_7b_tp8_decode_step_in_all_reduce():
    # docs/v100-field-guide.md#hardware: "TP across 8 GPUs costs ~10–15 % of a decode step for a 7B model".
    step = model().batch_time(decode(16))
    assert 0.08 <= step.communication_s / step.total_s <= 0.17


def test_it_charges_eager_mode_about_field_notes_fifteen_to_twenty_percent():
    eager = model(eager=True).batch_time(decode(16)).total_s
    graphs = model(eager=False).batch_time(decode(16)).total_s
    assert 0.1 <= 1 - graphs / eager <= 0.25


def test_it_makes_tensor_parallelism_over_pcie_slower_than_over_nvlink():
    nvlink = model(nvlink=True).batch_time(decode(64))
    pcie = model(nvlink=False).batch_time(decode(64))
    assert pcie.communication_s > 3 * nvlink.communication_s


def test_it_puts_a_1000_token_prefill_at_a_few_times_the_ideal():
    # docs/v100-field-guide.md#hardware: ideal ≈ 14 ms across 8 V100s; "real prefill takes 3–4× the ideal".
    ideal = Sizing(LLAMA_7B, ProfileSettings(tensor_parallel_size=8), V100).prefill_s_ideal(1000)
    step = model().batch_time(BatchShape.of([ScheduledChunk(0, 1000, True)]))
    assert 2.3 <= step.total_s / ideal <= 4


def test_it_grows_a_decode_step_with_the_kv_cache_it_reads():
    short = model().batch_time(decode(64, context=200)).total_s
    long = model().batch_time(decode(64, context=3000)).total_s
    assert long > 2 * short


def test_it_costs_nothing_for_an_empty_step():
    assert model().batch_time(BatchShape.of([])).total_s == 0
