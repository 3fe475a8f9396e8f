"""The attention path a node's vLLM runs on Volta changes what the simulator predicts for it
(inference.engines.attention_slowdown): a V1 line (FlexAttention/Triton) is slower there than the
V0 line the V100 figures were fitted on; elsewhere, and for an unknown version, nothing changes."""

from __future__ import annotations

import pytest
from django.core.management import CommandError, call_command

from inference.engines import V1_VOLTA_ATTENTION_SLOWDOWN, attention_slowdown
from inference.hardware import get_gpu
from inference.hf_config import resolve_model_config
from inference.profile import ProfileSettings
from inference.sim.costs import BatchShape, ScheduledChunk, StepCostModel
from portal.deployments.predict import predict_sweep

LLAMA_7B = resolve_model_config("llama-2-7b-chat-hf")
V100 = get_gpu("v100-sxm2-32gb")


@pytest.mark.parametrize(
    ("version", "gpu", "factor"),
    [
        ("0.19.1", "v100-sxm2-32gb", V1_VOLTA_ATTENTION_SLOWDOWN),
        ("0.8.5.post2+cpu", "v100-sxm2-32gb", 1.0),
        ("0.19.1", "a100-sxm4-80gb", 1.0),
        ("", "v100-sxm2-32gb", 1.0),
        ("not-a-version", "v100-sxm2-32gb", 1.0),
    ],
)
def test_it_slows_attention_only_for_a_v1_line_on_volta(version, gpu, factor):
    assert attention_slowdown(version, get_gpu(gpu).cc_tuple) == factor


def _costs(factor: float) -> StepCostModel:
    profile = ProfileSettings(tensor_parallel_size=1, enforce_eager=True, max_model_len=4096)
    return StepCostModel(LLAMA_7B, profile, V100, attention_slowdown=factor)


def test_a_slower_attention_path_costs_kv_reads_and_attention_not_weights():
    fast, slow = _costs(1.0), _costs(V1_VOLTA_ATTENTION_SLOWDOWN)
    no_context = BatchShape.of([ScheduledChunk(0, 1, True)])
    long_context = BatchShape.of([ScheduledChunk(2000, 1, True)] * 32)

    # The one new token's own KV is all a context-free step reads: the weights dominate.
    assert slow.batch_time(no_context).memory_s == pytest.approx(
        fast.batch_time(no_context).memory_s, rel=1e-3
    )
    assert slow.batch_time(long_context).memory_s > 1.5 * fast.batch_time(long_context).memory_s
    prefill = BatchShape.of([ScheduledChunk(0, 2000, True)])
    assert slow.batch_time(prefill).compute_s > fast.batch_time(prefill).compute_s


def _sweep(engine_version: str) -> dict:
    return predict_sweep(
        model="llama-2-7b-chat-hf",
        gpu="v100-sxm2-32gb",
        gpus=1,
        mix="fixed:1000:100",
        concurrency=[16],
        requests_per_level=32,
        enforce_eager=True,
        engine_version=engine_version,
    )


@pytest.mark.django_db
def test_the_same_profile_is_predicted_slower_on_a_v1_line_than_on_the_v0_line():
    v0 = _sweep("0.8.5")["levels"][0]
    v1 = _sweep("0.19.1")["levels"][0]

    assert v1["output_throughput"] < 0.9 * v0["output_throughput"]
    assert v1["mean_tpot_ms"] > v0["mean_tpot_ms"]


@pytest.mark.django_db
def test_plan_names_the_known_lines_for_an_unknown_engine_version():
    with pytest.raises(CommandError, match=r"--engine-version: unknown vLLM version 'banana'.*0\.8\.5"):
        call_command(
            "plan",
            "--gpu",
            "v100-sxm2-32gb",
            "--gpus",
            "1",
            "--model",
            "llama-2-7b-chat-hf",
            "--engine-version",
            "banana",
        )
