"""The planner: weights, KV capacity and rooflines, checked against the reference
arithmetic of docs/v100-field-guide.md#reference-arithmetic."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from inference.errors import InputError
from inference.hardware import get_gpu
from inference.planner import (
    Finding,
    Placement,
    kv_cache_bytes_per_token,
    plan_deployment,
    serving_dtype,
    weights_bytes,
)
from inference.profile import ProfileSettings
from tests.helpers.planner import gemma2_27b_gptq, llama2_7b, llama31_70b_fp16, llama31_70b_gptq

V100_32 = get_gpu("v100-sxm2-32gb")
V100_16 = get_gpu("v100-pcie-16gb")
A100_80 = get_gpu("a100-sxm4-80gb")


def node(gpu=V100_32, gpu_count: int = 1, nvlink_connected: bool | None = True) -> Placement:
    return Placement(gpu=gpu, gpu_count=gpu_count, nvlink_connected=nvlink_connected)


def tp8_v100_node() -> Placement:
    return node(V100_32, gpu_count=8)


# Reference arithmetic (docs/v100-field-guide.md#reference-arithmetic), within ±10 %.


def test_it_puts_about_1_75_gb_of_llama2_7b_fp16_weights_on_each_of_8_gpus():
    plan = plan_deployment(llama2_7b(), ProfileSettings(tensor_parallel_size=8), tp8_v100_node())
    assert plan.weights_gb_per_gpu == pytest.approx(1.75, rel=0.10)


def test_it_takes_about_2_3_ms_per_7b_tp8_decode_step_at_effective_bandwidth():
    plan = plan_deployment(llama2_7b(), ProfileSettings(tensor_parallel_size=8), tp8_v100_node())
    assert plan.decode_step_ms_at_effective_bandwidth == pytest.approx(2.3, rel=0.10)


def test_it_caps_gemma2_27b_4bit_decode_near_62_tokens_per_s_on_one_v100():
    plan = plan_deployment(gemma2_27b_gptq(), ProfileSettings(), node(V100_16))
    assert plan.decode_tokens_per_s_ceiling == pytest.approx(62, rel=0.10)


def test_it_puts_about_5_gb_of_70b_4bit_weights_on_each_of_8_gpus():
    plan = plan_deployment(llama31_70b_gptq(), ProfileSettings(tensor_parallel_size=8), tp8_v100_node())
    assert plan.weights_gb_per_gpu == pytest.approx(5, rel=0.10)


def test_it_caps_llama31_70b_4bit_tp8_decode_near_180_tokens_per_s():
    plan = plan_deployment(llama31_70b_gptq(), ProfileSettings(tensor_parallel_size=8), tp8_v100_node())
    assert plan.decode_tokens_per_s_ceiling == pytest.approx(180, rel=0.10)


def test_it_counts_about_1_4e13_flops_to_prefill_1000_tokens_of_a_7b_model():
    assert 2 * llama2_7b().param_count * 1000 == pytest.approx(1.4e13, rel=0.10)


def test_it_prefills_1000_tokens_of_7b_in_about_0_11_s_ideal_on_one_v100():
    plan = plan_deployment(llama2_7b(), ProfileSettings(), node())
    assert plan.prefill_ms_per_1k_tokens_ideal == pytest.approx(110, rel=0.10)


def test_it_prefills_1000_tokens_of_7b_in_about_14_ms_ideal_over_8_v100s():
    plan = plan_deployment(llama2_7b(), ProfileSettings(tensor_parallel_size=8), tp8_v100_node())
    assert plan.prefill_ms_per_1k_tokens_ideal == pytest.approx(14, rel=0.10)


def test_it_expects_real_prefill_to_take_3_5_times_the_ideal():
    plan = plan_deployment(llama2_7b(), ProfileSettings(), node())
    assert plan.prefill_ms_per_1k_tokens_expected == pytest.approx(3.5 * plan.prefill_ms_per_1k_tokens_ideal)


def test_it_reads_the_fp16_peak_of_the_pcie_v100_for_prefill():
    sxm = plan_deployment(llama2_7b(), ProfileSettings(), node(V100_32))
    pcie = plan_deployment(llama2_7b(), ProfileSettings(), node(get_gpu("v100-pcie-32gb")))
    expected = sxm.prefill_ms_per_1k_tokens_ideal * 125 / 112
    assert pcie.prefill_ms_per_1k_tokens_ideal == pytest.approx(expected)


# Weights.


def test_it_sizes_unquantized_weights_as_params_times_serving_dtype_bytes():
    model = llama2_7b()
    assert weights_bytes(model, ProfileSettings(), V100_32) == model.param_count * 2


def test_it_sizes_float32_weights_at_4_bytes_per_param():
    model = llama2_7b()
    assert weights_bytes(model, ProfileSettings(dtype="float32"), V100_32) == model.param_count * 4


def test_it_keeps_a_gptq_models_embeddings_and_norms_in_fp16():
    model = llama31_70b_gptq()
    linear = model.linear_params * (4 + (16 + 4) / 128) / 8
    rest = (model.param_count - model.linear_params) * 2
    assert weights_bytes(model, ProfileSettings(), V100_32) == pytest.approx(linear + rest)


def test_it_assumes_4_bits_and_groups_of_128_when_a_gptq_model_does_not_say():
    stated = llama31_70b_gptq()
    unstated = llama31_70b_gptq(quant_bits=None, quant_group_size=None)
    profile = ProfileSettings()
    assert weights_bytes(unstated, profile, V100_32) == weights_bytes(stated, profile, V100_32)


def test_it_drops_the_group_overhead_for_per_channel_gptq():
    per_group = weights_bytes(llama31_70b_gptq(), ProfileSettings(), V100_32)
    per_channel = weights_bytes(llama31_70b_gptq(quant_group_size=-1), ProfileSettings(), V100_32)
    assert per_channel < per_group


def test_it_halves_linear_weights_when_fp8_quantizes_them_on_the_fly():
    model = llama2_7b()
    fp8 = weights_bytes(model, ProfileSettings(quantization="fp8"), A100_80)
    assert fp8 == pytest.approx(model.linear_params + (model.param_count - model.linear_params) * 2)


def test_it_shards_the_weights_evenly_over_the_tensor_parallel_group():
    plan = plan_deployment(llama2_7b(), ProfileSettings(tensor_parallel_size=4), node(gpu_count=4))
    assert plan.weights_gb_per_gpu == pytest.approx(plan.weights_gb_total / 4)


def test_it_serves_bf16_weights_as_float16_on_volta_with_auto_dtype():
    model = llama2_7b(weight_dtype="bfloat16")
    assert serving_dtype(model, ProfileSettings(dtype="auto"), V100_32) == "float16"


def test_it_serves_bf16_weights_as_bf16_on_ampere_with_auto_dtype():
    model = llama2_7b(weight_dtype="bfloat16")
    assert serving_dtype(model, ProfileSettings(dtype="auto"), A100_80) == "bfloat16"


def test_it_serves_float32_checkpoints_in_half_precision_with_auto_dtype():
    model = llama2_7b(weight_dtype="float32")
    assert serving_dtype(model, ProfileSettings(dtype="auto"), A100_80) == "float16"


def test_it_serves_the_dtype_the_profile_names():
    assert serving_dtype(llama2_7b(), ProfileSettings(dtype="float32"), V100_32) == "float32"


# KV cache.


def test_it_needs_524288_kv_bytes_per_token_for_llama2_7b_fp16_on_one_gpu():
    # 2 (K and V) x 32 layers x 32 KV heads x 128 head_dim x 2 bytes.
    assert kv_cache_bytes_per_token(llama2_7b(), ProfileSettings(), V100_32) == 524288


def test_it_divides_kv_bytes_per_token_by_the_tensor_parallel_size():
    per_gpu = kv_cache_bytes_per_token(llama2_7b(), ProfileSettings(tensor_parallel_size=8), V100_32)
    assert per_gpu == 524288 // 8


def test_it_replicates_kv_heads_when_tp_exceeds_their_number():
    # Llama-3.1-70B has 8 KV heads: at TP16 each GPU still holds one whole head.
    tp16 = kv_cache_bytes_per_token(llama31_70b_gptq(), ProfileSettings(tensor_parallel_size=16), V100_32)
    assert tp16 == 2 * 80 * 1 * 128 * 2


def test_it_halves_kv_bytes_with_an_fp8_kv_cache():
    fp8 = kv_cache_bytes_per_token(llama2_7b(), ProfileSettings(kv_cache_dtype="fp8"), V100_32)
    assert fp8 == 524288 // 2


def test_it_fits_about_31_thousand_kv_tokens_for_7b_fp16_on_one_32gb_v100():
    # 30.9 GB usable at 0.9 - 13.5 GB weights - 0.9 GB allowance = 16.6 GB / 524288 B per token.
    plan = plan_deployment(llama2_7b(), ProfileSettings(), node())
    assert plan.kv_cache_tokens == pytest.approx(31_600, rel=0.02)


def test_it_gives_the_deployment_the_per_gpu_kv_capacity_under_tp():
    plan = plan_deployment(llama2_7b(), ProfileSettings(tensor_parallel_size=8), tp8_v100_node())
    per_gpu_tokens = plan.kv_cache_gb_per_gpu * 1e9 / plan.kv_cache_bytes_per_token_per_gpu
    assert plan.kv_cache_tokens == pytest.approx(per_gpu_tokens, abs=16)


def test_it_rounds_kv_tokens_down_to_whole_blocks():
    plan = plan_deployment(llama2_7b(), ProfileSettings(block_size=128), node())
    assert plan.kv_cache_tokens % 128 == 0


def test_it_has_no_kv_tokens_when_the_weights_do_not_fit():
    plan = plan_deployment(llama31_70b_fp16(), ProfileSettings(max_model_len=4096), node())
    assert (plan.kv_cache_tokens, plan.kv_cache_gb_per_gpu) == (0, 0.0)


def test_it_counts_whole_sequences_of_max_model_len_in_the_kv_cache():
    plan = plan_deployment(llama2_7b(), ProfileSettings(max_model_len=4096), node())
    assert plan.max_concurrent_seqs_at_max_len == plan.kv_cache_tokens // 4096


def test_it_holds_more_kv_tokens_with_a_higher_memory_utilization():
    low = plan_deployment(llama2_7b(), ProfileSettings(gpu_memory_utilization=0.8), node())
    high = plan_deployment(llama2_7b(), ProfileSettings(gpu_memory_utilization=0.9), node())
    assert high.kv_cache_tokens > low.kv_cache_tokens


# Allowance and defaults.


def test_it_holds_back_at_least_the_cuda_context_for_activations():
    plan = plan_deployment(llama2_7b(), ProfileSettings(), node())
    assert plan.allowance_gb_per_gpu > 0.5 * 2**30 / 1e9


def test_it_holds_back_more_for_a_bigger_token_budget():
    small = plan_deployment(llama2_7b(), ProfileSettings(max_num_batched_tokens=4096), node())
    big = plan_deployment(llama2_7b(), ProfileSettings(max_num_batched_tokens=16384), node())
    assert big.allowance_gb_per_gpu > small.allowance_gb_per_gpu


def test_it_defaults_max_model_len_to_the_models_positions():
    plan = plan_deployment(llama2_7b(), ProfileSettings(max_model_len=None), node())
    assert plan.max_model_len == 4096


def test_it_budgets_2048_batched_tokens_with_chunked_prefill():
    profile = ProfileSettings(enable_chunked_prefill=True, max_model_len=4096)
    assert plan_deployment(llama2_7b(), profile, node()).max_num_batched_tokens == 2048


def test_it_budgets_a_whole_max_len_prompt_per_step_without_chunked_prefill():
    profile = ProfileSettings(enable_chunked_prefill=False, max_model_len=4096)
    assert plan_deployment(llama2_7b(), profile, node()).max_num_batched_tokens == 4096


def test_it_budgets_at_least_2048_batched_tokens_for_short_contexts():
    profile = ProfileSettings(max_model_len=1024)
    assert plan_deployment(llama2_7b(), profile, node()).max_num_batched_tokens == 2048


# Bad input.


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("tensor_parallel_size", 0),
        ("tensor_parallel_size", -2),
        ("tensor_parallel_size", 65),
        ("tensor_parallel_size", 2.5),
        ("max_model_len", 0),
        ("max_model_len", 10_000_001),
        ("max_num_seqs", 0),
        ("max_num_seqs", 65_537),
        ("max_num_batched_tokens", -1),
        ("gpu_memory_utilization", 0),
        ("gpu_memory_utilization", 1.01),
        ("gpu_memory_utilization", "0.9"),
        ("block_size", 24),
        ("swap_space_gb", -1),
        ("dtype", "half-ish"),
        ("kv_cache_dtype", "int4"),
        ("quantization", "magic"),
    ],
)
def test_it_rejects_an_impossible_profile_value_naming_the_field(field, value):
    with pytest.raises(InputError) as caught:
        ProfileSettings(**{field: value})
    assert caught.value.field == field


def test_it_lists_the_choices_when_a_dtype_is_unknown():
    with pytest.raises(InputError) as caught:
        ProfileSettings(dtype="fp16")
    assert "auto, float16, bfloat16, float32" in caught.value.message


def test_it_accepts_a_tensor_parallel_size_of_3_for_the_rules_to_judge():
    assert ProfileSettings(tensor_parallel_size=3).tensor_parallel_size == 3


def test_it_rejects_a_placement_without_gpus():
    with pytest.raises(InputError) as caught:
        Placement(gpu=V100_32, gpu_count=0)
    assert caught.value.field == "gpu_count"


# The plan object.


def test_it_is_ok_when_no_finding_is_an_error():
    plan = plan_deployment(llama2_7b(), ProfileSettings(), node())
    assert [f.level for f in plan.findings if f.level == "error"] == []
    assert plan.ok is True


def test_it_is_not_ok_when_a_finding_is_an_error():
    plan = plan_deployment(llama2_7b(), ProfileSettings(dtype="bfloat16"), node())
    assert plan.ok is False


def test_it_exposes_the_contract_keys_in_to_dict():
    data = plan_deployment(llama2_7b(), ProfileSettings(), node()).to_dict()
    contract = {
        "weights_gb_per_gpu",
        "kv_cache_tokens",
        "max_concurrent_seqs_at_max_len",
        "decode_tokens_per_s_ceiling",
        "findings",
        "ok",
    }
    assert contract <= set(data)


def test_it_serialises_to_json():
    data = plan_deployment(llama2_7b(), ProfileSettings(), node()).to_dict()
    assert json.loads(json.dumps(data)) == data


def test_it_lists_findings_as_level_code_and_message():
    data = plan_deployment(llama2_7b(), ProfileSettings(dtype="bfloat16"), node()).to_dict()
    assert {"level": "error", "code": "bf16_unsupported"}.items() <= data["findings"][0].items()
    assert set(data["findings"][0]) == {"level", "code", "message"}


def test_it_rounds_floats_for_display_but_keeps_full_precision():
    plan = plan_deployment(llama2_7b(), ProfileSettings(), node())
    assert plan.to_dict()["decode_tokens_per_s_ceiling"] == round(plan.decode_tokens_per_s_ceiling, 3)
    assert plan.decode_tokens_per_s_ceiling != round(plan.decode_tokens_per_s_ceiling, 3)


def test_it_treats_a_plan_with_only_warnings_as_ok():
    plan = replace(
        plan_deployment(llama2_7b(), ProfileSettings(), node()),
        findings=(Finding("warning", "w", "watch out"), Finding("info", "i", "fyi")),
    )
    assert plan.ok is True


def test_it_finds_a_profile_the_nodes_vllm_version_cannot_parse_before_launch():
    placement = Placement(gpu=V100_32, gpu_count=1, engine_version="0.26.0")
    plan = plan_deployment(llama2_7b(), ProfileSettings(swap_space_gb=8), placement)
    finding = next(f for f in plan.findings if f.code == "engine_version_lacks_flag")
    assert finding.level == "error" and "vLLM 0.26–0.31 has no --swap-space" in finding.message
    assert not plan.ok


def test_it_warns_that_a_v1_line_on_volta_runs_slower_attention_than_planned():
    plan = plan_deployment(llama2_7b(), ProfileSettings(), Placement(gpu=V100_32, engine_version="0.19.1"))
    finding = next(f for f in plan.findings if f.code == "v1_attention_on_volta")
    assert finding.level == "warning" and "FlexAttention" in finding.message and "0.8.5" in finding.message


def test_it_says_a_v0_line_on_volta_runs_the_path_the_figures_were_measured_on():
    plan = plan_deployment(
        llama2_7b(), ProfileSettings(), Placement(gpu=V100_32, engine_version="0.8.5.post1")
    )
    assert [f.level for f in plan.findings if f.code == "v0_engine_on_volta"] == ["info"]
    assert not any(f.code == "v1_attention_on_volta" for f in plan.findings)
