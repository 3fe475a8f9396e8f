"""The profile rules: each fires on the case it is for and stays quiet on a sound one."""

from __future__ import annotations

from dataclasses import replace

import pytest

from inference.hardware import get_gpu
from inference.planner import Placement, Sizing, plan_deployment
from inference.profile import ProfileSettings
from inference.rules import Finding, validate
from tests.helpers.planner import llama2_7b, llama31_70b_fp16, llama31_70b_gptq

V100_32 = get_gpu("v100-sxm2-32gb")
V100_16 = get_gpu("v100-pcie-16gb")
A100_80 = get_gpu("a100-sxm4-80gb")
T4 = get_gpu("t4")


def sound(**changes) -> ProfileSettings:
    """A profile the field notes would sign off for 7B on one V100-32GB."""
    base = ProfileSettings(max_model_len=4096, max_num_seqs=16, enforce_eager=True)
    return replace(base, **changes)


def node(gpu=V100_32, gpu_count: int = 1, nvlink_connected: bool | None = True) -> Placement:
    return Placement(gpu=gpu, gpu_count=gpu_count, nvlink_connected=nvlink_connected)


def findings(model, profile, placement) -> dict[str, Finding]:
    return {finding.code: finding for finding in plan_deployment(model, profile, placement).findings}


def test_it_finds_nothing_wrong_with_a_sound_v100_profile():
    assert findings(llama2_7b(), sound(), node()) == {}


def test_it_lists_errors_before_warnings_and_infos():
    profile = sound(dtype="bfloat16", enforce_eager=False, tensor_parallel_size=2)
    model, placement = llama2_7b(), node(gpu_count=2)
    levels = [f.level for f in validate(model, profile, placement, Sizing(model, profile, V100_32))]
    assert levels == sorted(levels, key=("error", "warning", "info").index)


# bf16_unsupported


def test_it_refuses_bf16_on_a_v100():
    finding = findings(llama2_7b(), sound(dtype="bfloat16"), node())["bf16_unsupported"]
    assert finding.level == "error"
    assert "sm_70" in finding.message
    assert "--dtype float16" in finding.message


def test_it_allows_bf16_on_an_a100():
    assert "bf16_unsupported" not in findings(llama2_7b(), sound(dtype="bfloat16"), node(A100_80))


# bf16_weights_auto_dtype


def test_it_warns_when_auto_dtype_meets_bf16_weights_on_a_v100():
    model = llama2_7b(weight_dtype="bfloat16")
    finding = findings(model, sound(dtype="auto"), node())["bf16_weights_auto_dtype"]
    assert finding.level == "warning"
    assert "garbage" in finding.message


def test_it_does_not_warn_when_float16_is_set_for_bf16_weights():
    model = llama2_7b(weight_dtype="bfloat16")
    assert "bf16_weights_auto_dtype" not in findings(model, sound(dtype="float16"), node())


# bf16_weights_cast_to_fp16


def test_it_warns_that_float16_casts_bf16_weights_on_a_v100():
    model = llama2_7b(weight_dtype="bfloat16")
    finding = findings(model, sound(dtype="float16"), node())["bf16_weights_cast_to_fp16"]
    assert finding.level == "warning"
    assert "65504" in finding.message


def test_it_does_not_warn_about_casting_float16_weights():
    assert "bf16_weights_cast_to_fp16" not in findings(llama2_7b(), sound(dtype="float16"), node())


def test_it_does_not_warn_about_casting_bf16_weights_on_an_a100():
    model = llama2_7b(weight_dtype="bfloat16")
    assert "bf16_weights_cast_to_fp16" not in findings(model, sound(dtype="float16"), node(A100_80))


# awq_unsupported / quantization_unsupported


def test_it_refuses_an_awq_model_on_a_v100():
    finding = findings(llama2_7b(quantization="awq"), sound(), node())["awq_unsupported"]
    assert finding.level == "error"
    assert "7.5" in finding.message
    assert "GPTQ" in finding.message


def test_it_refuses_an_awq_profile_on_a_v100():
    model = llama2_7b(quantization="awq")
    assert "awq_unsupported" in findings(model, sound(quantization="awq"), node())


def test_it_allows_an_awq_model_on_a_t4():
    assert "awq_unsupported" not in findings(llama2_7b(quantization="awq"), sound(), node(T4))


def test_it_allows_a_gptq_model_on_a_v100():
    codes = findings(llama31_70b_gptq(), sound(tensor_parallel_size=8), node(gpu_count=8))
    assert {"awq_unsupported", "quantization_unsupported"}.isdisjoint(codes)


def test_it_refuses_marlin_kernels_on_a_v100_and_suggests_plain_gptq():
    model = llama31_70b_gptq()
    profile = sound(tensor_parallel_size=8, quantization="gptq_marlin")
    finding = findings(model, profile, node(gpu_count=8))["quantization_unsupported"]
    assert "--quantization gptq" in finding.message


# quantization_mismatch


def test_it_refuses_a_profile_quantization_the_weights_do_not_have():
    finding = findings(llama2_7b(), sound(quantization="gptq"), node())["quantization_mismatch"]
    assert finding.level == "error"
    assert "not quantized" in finding.message


def test_it_accepts_a_marlin_kernel_over_a_gptq_checkpoint():
    model = llama31_70b_gptq()
    profile = sound(quantization="gptq_marlin", max_num_seqs=8)
    assert "quantization_mismatch" not in findings(model, profile, node(A100_80))


def test_it_accepts_fp8_on_the_fly_over_unquantized_weights():
    assert "quantization_mismatch" not in findings(llama2_7b(), sound(quantization="fp8"), node(A100_80))


# weights_do_not_fit


def test_it_refuses_weights_that_do_not_fit():
    finding = findings(llama31_70b_fp16(), sound(), node())["weights_do_not_fit"]
    assert finding.level == "error"


def test_it_suggests_the_tensor_parallel_size_that_would_fit():
    # 141 GB of fp16 weights: 17.6 GB per GPU at TP8 fits a 32 GB card, TP4's 35 GB does not.
    finding = findings(llama31_70b_fp16(), sound(), node())["weights_do_not_fit"]
    assert "--tensor-parallel-size 8 (needs 8 GPUs; the placement has 1)" in finding.message


def test_it_suggests_a_4bit_build_when_the_weights_do_not_fit():
    finding = findings(llama31_70b_fp16(), sound(), node())["weights_do_not_fit"]
    assert "4-bit GPTQ build of the model (~39.8 GB) at --tensor-parallel-size 2" in finding.message


def test_it_finds_room_for_7b_weights_on_a_32gb_v100():
    assert "weights_do_not_fit" not in findings(llama2_7b(), sound(), node())


# kv_cache_too_small


def test_it_refuses_a_kv_cache_smaller_than_one_max_len_sequence():
    finding = findings(llama2_7b(), sound(), node(V100_16))["kv_cache_too_small"]
    assert finding.level == "error"


def test_it_suggests_the_max_model_len_that_fits_the_kv_cache():
    plan = plan_deployment(llama2_7b(), sound(), node(V100_16))
    message = next(f.message for f in plan.findings if f.code == "kv_cache_too_small")
    assert f"Set max_model_len to {plan.kv_cache_tokens:,} or less" in message


def test_it_does_not_blame_the_kv_cache_when_the_weights_do_not_fit():
    assert "kv_cache_too_small" not in findings(llama31_70b_fp16(), sound(), node())


def test_it_accepts_a_kv_cache_that_holds_a_max_len_sequence():
    assert "kv_cache_too_small" not in findings(llama2_7b(), sound(), node())


# tp_not_divisor


def test_it_refuses_a_tensor_parallel_size_that_does_not_divide_the_heads():
    finding = findings(llama2_7b(), sound(tensor_parallel_size=3), node(gpu_count=8))["tp_not_divisor"]
    assert finding.level == "error"
    assert "Valid sizes on 8 GPUs: 1, 2, 4, 8." in finding.message


def test_it_refuses_a_tensor_parallel_size_the_kv_heads_cannot_follow():
    # 24 heads split 6 ways, but 8 KV heads neither split nor replicate 6 ways.
    model = llama2_7b(num_attention_heads=24, num_kv_heads=8)
    assert "tp_not_divisor" in findings(model, sound(tensor_parallel_size=6), node(gpu_count=8))


def test_it_accepts_a_tensor_parallel_size_that_divides_the_heads():
    assert "tp_not_divisor" not in findings(llama2_7b(), sound(tensor_parallel_size=4), node(gpu_count=4))


# tp_exceeds_gpus


def test_it_refuses_a_tensor_parallel_size_beyond_the_gpus_available():
    finding = findings(llama2_7b(), sound(tensor_parallel_size=8), node(gpu_count=4))["tp_exceeds_gpus"]
    assert finding.level == "error"


def test_it_accepts_a_tensor_parallel_size_equal_to_the_gpus_available():
    assert "tp_exceeds_gpus" not in findings(llama2_7b(), sound(tensor_parallel_size=4), node(gpu_count=4))


# tp_over_pcie


def test_it_warns_about_tensor_parallelism_over_pcie():
    placement = node(gpu_count=2, nvlink_connected=False)
    finding = findings(llama2_7b(), sound(tensor_parallel_size=2), placement)["tp_over_pcie"]
    assert finding.level == "warning"
    assert "single-GPU or TP2 instances" in finding.message


def test_it_does_not_warn_about_tensor_parallelism_over_nvlink():
    placement = node(gpu_count=2, nvlink_connected=True)
    assert "tp_over_pcie" not in findings(llama2_7b(), sound(tensor_parallel_size=2), placement)


# gpu_memory_utilization_high


def test_it_warns_about_memory_utilization_above_0_93_on_a_v100():
    finding = findings(llama2_7b(), sound(gpu_memory_utilization=0.95), node())["gpu_memory_utilization_high"]
    assert finding.level == "warning"


def test_it_accepts_memory_utilization_of_0_93_on_a_v100():
    profile = sound(gpu_memory_utilization=0.93)
    assert "gpu_memory_utilization_high" not in findings(llama2_7b(), profile, node())


def test_it_accepts_high_memory_utilization_off_volta():
    profile = sound(gpu_memory_utilization=0.95)
    assert "gpu_memory_utilization_high" not in findings(llama2_7b(), profile, node(A100_80))


# eager_off_on_volta


def test_it_warns_about_cuda_graphs_on_a_v100():
    finding = findings(llama2_7b(), sound(enforce_eager=False), node())["eager_off_on_volta"]
    assert "--enforce-eager" in finding.message


def test_it_accepts_cuda_graphs_off_volta():
    assert "eager_off_on_volta" not in findings(llama2_7b(), sound(enforce_eager=False), node(A100_80))


# max_num_seqs_preemption


def test_it_warns_that_256_seqs_preempt_on_a_single_16gb_v100():
    profile = sound(max_model_len=8192, max_num_seqs=256)
    model = llama2_7b(max_position_embeddings=8192)
    finding = findings(model, profile, node(V100_16))["max_num_seqs_preemption"]
    assert finding.level == "warning"


def test_it_accepts_256_seqs_for_7b_over_8_32gb_v100s():
    profile = sound(tensor_parallel_size=8, max_model_len=8192, max_num_seqs=256)
    model = llama2_7b(max_position_embeddings=8192)
    assert "max_num_seqs_preemption" not in findings(model, profile, node(gpu_count=8))


def test_it_suggests_the_number_of_typical_sequences_the_kv_cache_holds():
    # ~31.6k KV tokens hold 15 sequences of 2048 tokens.
    finding = findings(llama2_7b(), sound(max_num_seqs=64), node())["max_num_seqs_preemption"]
    assert "Set max_num_seqs to about 15" in finding.message


# max_model_len_exceeds_positions


def test_it_refuses_a_max_model_len_beyond_the_models_positions():
    finding = findings(llama2_7b(), sound(max_model_len=8192), node())["max_model_len_exceeds_positions"]
    assert finding.level == "error"
    assert "4,096" in finding.message


def test_it_accepts_a_max_model_len_within_the_models_positions():
    assert "max_model_len_exceeds_positions" not in findings(llama2_7b(), sound(max_model_len=4096), node())


# tp_for_small_model


def test_it_suggests_single_gpu_instances_for_7b_over_8_gpus():
    finding = findings(llama2_7b(), sound(tensor_parallel_size=8), node(gpu_count=8))["tp_for_small_model"]
    assert finding.level == "info"


def test_it_keeps_quiet_about_tensor_parallelism_for_a_70b_model():
    profile = sound(tensor_parallel_size=8, max_model_len=8192)
    assert "tp_for_small_model" not in findings(llama31_70b_gptq(), profile, node(gpu_count=8))


# long_context_on_volta


def test_it_notes_that_contexts_past_8192_gain_little_on_a_v100():
    profile = sound(tensor_parallel_size=8, max_model_len=16384)
    finding = findings(llama31_70b_gptq(), profile, node(gpu_count=8))["long_context_on_volta"]
    assert finding.level == "info"


def test_it_accepts_an_8192_context_on_a_v100():
    profile = sound(tensor_parallel_size=8, max_model_len=8192)
    assert "long_context_on_volta" not in findings(llama31_70b_gptq(), profile, node(gpu_count=8))


def test_it_accepts_long_contexts_off_volta():
    profile = sound(max_model_len=16384)
    assert "long_context_on_volta" not in findings(llama31_70b_gptq(), profile, node(A100_80))


# batched_tokens_below_max_len


def test_it_refuses_a_token_budget_below_max_len_without_chunked_prefill():
    profile = sound(max_num_batched_tokens=2048)
    assert "batched_tokens_below_max_len" in findings(llama2_7b(), profile, node())


def test_it_accepts_a_token_budget_below_max_len_with_chunked_prefill():
    profile = sound(max_num_batched_tokens=2048, enable_chunked_prefill=True)
    assert "batched_tokens_below_max_len" not in findings(llama2_7b(), profile, node())


def test_it_advises_a_larger_budget_not_chunked_prefill_on_a_v100():
    profile = sound(max_num_batched_tokens=2048)

    on_volta = findings(llama2_7b(), profile, node())["batched_tokens_below_max_len"].message
    off_volta = findings(llama2_7b(), profile, node(A100_80))["batched_tokens_below_max_len"].message

    assert "Enable chunked prefill" not in on_volta
    assert "Raise max_num_batched_tokens to at least 4,096" in on_volta
    assert "Enable chunked prefill" in off_volta


# chunked_prefill_on_volta, prefix_caching_on_volta: vLLM's feature × hardware table


@pytest.mark.parametrize(
    ("flag", "code", "issue"),
    [
        ("enable_chunked_prefill", "chunked_prefill_on_volta", "vllm#2729"),
        ("enable_prefix_caching", "prefix_caching_on_volta", "vllm#3687"),
    ],
)
def test_it_warns_that_vllm_marks_the_feature_unsupported_on_volta(flag, code, issue):
    finding = findings(llama2_7b(), sound(**{flag: True}), node())[code]

    assert finding.level == "warning"
    # It names its source, the vLLM versions it applies to, and how to check a node.
    assert "docs/features/README.md" in finding.message and "Feature x Hardware" in finding.message
    assert issue in finding.message and "vLLM 0.6 through the current docs" in finding.message
    assert "`manage.py accept_node <node> --agent --profile <profile>`" in finding.message
    assert "feature_probe step fails, naming the feature" in finding.message


@pytest.mark.parametrize("flag", ["enable_chunked_prefill", "enable_prefix_caching"])
def test_it_keeps_quiet_about_those_features_off_volta(flag):
    assert findings(llama2_7b(), sound(**{flag: True}), node(A100_80)) == {}
