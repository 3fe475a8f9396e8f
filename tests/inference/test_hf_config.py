"""Reading Hugging Face config.json files into ModelArch."""

from __future__ import annotations

import copy
import json

import pytest

from inference.errors import InputError
from inference.hf_config import (
    arch_from_config,
    known_configs,
    load_config,
    resolve_model_config,
)

BUNDLED = [
    "gemma-2-27b-it-gptq-4bit",
    "llama-2-13b-chat-hf",
    "llama-2-7b-chat-hf",
    "llama-3.1-70b-instruct-gptq-4bit",
    "mistral-7b-instruct-v0.3",
    "mistral-small-24b-instruct-2501",
    "qwen2.5-14b-instruct",
    "qwen2.5-7b-instruct",
]

# A small but complete Llama-style config for the bad-input tests.
LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "num_hidden_layers": 4,
    "hidden_size": 256,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "intermediate_size": 512,
    "vocab_size": 1000,
    "max_position_embeddings": 2048,
    "torch_dtype": "float16",
}


def llama(**changes):
    config = copy.deepcopy(LLAMA)
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    return config


def field_of(config) -> str:
    with pytest.raises(InputError) as caught:
        arch_from_config(config)
    return caught.value.field


# --- bundled configs -------------------------------------------------------------


def test_it_lists_the_bundled_configs_by_directory_name():
    assert list(known_configs()) == BUNDLED


@pytest.mark.parametrize("name", BUNDLED)
def test_it_loads_every_bundled_config(name):
    assert resolve_model_config(name).num_layers > 0


def test_it_reads_llama_2_7b():
    arch = resolve_model_config("llama-2-7b-chat-hf")
    assert (arch.model_type, arch.num_layers, arch.hidden_size) == ("llama", 32, 4096)
    assert (arch.num_attention_heads, arch.num_kv_heads, arch.head_dim) == (32, 32, 128)
    assert (arch.intermediate_size, arch.vocab_size, arch.max_position_embeddings) == (11008, 32000, 4096)
    assert arch.weight_dtype == "float16"
    assert arch.quantization is None
    assert arch.tie_word_embeddings is False


def test_it_reads_gemma_2_27b_gptq():
    arch = resolve_model_config("gemma-2-27b-it-gptq-4bit")
    assert (arch.model_type, arch.num_layers, arch.hidden_size) == ("gemma2", 46, 4608)
    assert (arch.num_attention_heads, arch.num_kv_heads, arch.head_dim) == (32, 16, 128)
    assert (arch.intermediate_size, arch.vocab_size, arch.max_position_embeddings) == (36864, 256000, 8192)
    assert arch.weight_dtype == "float16"
    assert (arch.quantization, arch.quant_bits, arch.quant_group_size) == ("gptq", 4, 128)


def test_it_reads_llama_3_1_70b_gptq():
    arch = resolve_model_config("llama-3.1-70b-instruct-gptq-4bit")
    assert (arch.num_layers, arch.hidden_size, arch.num_attention_heads, arch.num_kv_heads) == (
        80,
        8192,
        64,
        8,
    )
    assert (arch.intermediate_size, arch.vocab_size, arch.max_position_embeddings) == (28672, 128256, 131072)
    assert (arch.quantization, arch.quant_bits, arch.quant_group_size) == ("gptq", 4, 128)


def test_it_reads_mistral_small_24b_whose_heads_are_narrower_than_hidden_over_heads():
    # 5120 ÷ 32 heads would be 160; the published config says 128 (head_dim), as vLLM reads it.
    arch = resolve_model_config("mistral-small-24b-instruct-2501")
    assert (arch.num_layers, arch.hidden_size) == (40, 5120)
    assert (arch.num_attention_heads, arch.num_kv_heads) == (32, 8)
    assert (arch.head_dim, arch.intermediate_size, arch.vocab_size) == (128, 32768, 131072)


def test_it_reads_qwen2_5_as_bfloat16():
    assert resolve_model_config("qwen2.5-7b-instruct").weight_dtype == "bfloat16"


def test_it_reads_mistral_as_bfloat16_with_grouped_kv_heads():
    arch = resolve_model_config("mistral-7b-instruct-v0.3")
    assert (arch.model_type, arch.weight_dtype, arch.num_kv_heads, arch.vocab_size) == (
        "mistral",
        "bfloat16",
        8,
        32768,
    )


@pytest.mark.parametrize(
    ("name", "billions", "tolerance"),
    [
        ("llama-2-7b-chat-hf", 6.74, 0.01),
        ("llama-2-13b-chat-hf", 13.0, 0.01),
        ("gemma-2-27b-it-gptq-4bit", 27.2, 0.02),
        ("llama-3.1-70b-instruct-gptq-4bit", 70.6, 0.01),
        ("qwen2.5-7b-instruct", 7.6, 0.02),
    ],
)
def test_it_counts_the_published_parameters(name, billions, tolerance):
    assert resolve_model_config(name).param_count == pytest.approx(billions * 1e9, rel=tolerance)


def test_it_gives_qwen2_attention_biases():
    assert resolve_model_config("qwen2.5-7b-instruct").attention_bias is True


def test_it_gives_llama_no_attention_biases():
    assert resolve_model_config("llama-2-7b-chat-hf").attention_bias is False


def test_it_ties_gemma_embeddings_by_default():
    assert resolve_model_config("gemma-2-27b-it-gptq-4bit").tie_word_embeddings is True


def test_it_leaves_llama_embeddings_untied_by_default():
    assert arch_from_config(llama()).tie_word_embeddings is False


def test_it_honours_an_explicit_tie_word_embeddings():
    assert arch_from_config(llama(tie_word_embeddings=True)).tie_word_embeddings is True


# --- defaults and normalisation ----------------------------------------------------


def test_it_defaults_kv_heads_to_attention_heads():
    assert arch_from_config(llama(num_key_value_heads=None)).num_kv_heads == 8


def test_it_derives_head_dim_from_hidden_size():
    assert arch_from_config(llama()).head_dim == 32


def test_it_prefers_an_explicit_head_dim():
    assert arch_from_config(llama(head_dim=64)).head_dim == 64


def test_it_accepts_heads_that_do_not_divide_hidden_when_head_dim_is_given():
    assert (
        arch_from_config(llama(num_attention_heads=6, num_key_value_heads=None, head_dim=64)).head_dim == 64
    )


@pytest.mark.parametrize(
    ("dtype", "expected"),
    [
        ("float16", "float16"),
        ("half", "float16"),
        ("torch.float16", "float16"),
        ("bfloat16", "bfloat16"),
        ("BF16", "bfloat16"),
        ("float32", "float32"),
    ],
)
def test_it_normalises_the_weight_dtype(dtype, expected):
    assert arch_from_config(llama(torch_dtype=dtype)).weight_dtype == expected


def test_it_defaults_the_weight_dtype_to_float16():
    assert arch_from_config(llama(torch_dtype=None)).weight_dtype == "float16"


def test_it_reads_the_newer_dtype_key():
    assert arch_from_config(llama(torch_dtype=None, dtype="bfloat16")).weight_dtype == "bfloat16"


def test_it_lowercases_the_quant_method():
    config = llama(quantization_config={"quant_method": "AWQ", "bits": 4, "group_size": 128})
    assert arch_from_config(config).quantization == "awq"


def test_it_reads_group_size_minus_one_as_per_channel():
    config = llama(quantization_config={"quant_method": "gptq", "bits": 4, "group_size": -1})
    assert arch_from_config(config).quant_group_size is None


def test_it_reads_fp8_as_eight_bits():
    config = llama(quantization_config={"quant_method": "fp8", "activation_scheme": "dynamic"})
    assert (arch_from_config(config).quantization, arch_from_config(config).quant_bits) == ("fp8", 8)


def test_it_reads_bitsandbytes_4bit():
    config = llama(quantization_config={"quant_method": "bitsandbytes", "load_in_4bit": True})
    assert arch_from_config(config).quant_bits == 4


def test_it_reads_compressed_tensors_bits_from_the_weight_scheme():
    quant = {
        "quant_method": "compressed-tensors",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 4, "group_size": 128, "strategy": "group"},
            }
        },
    }
    arch = arch_from_config(llama(quantization_config=quant))
    assert (arch.quantization, arch.quant_bits, arch.quant_group_size) == ("compressed-tensors", 4, 128)


# --- nested text_config --------------------------------------------------------------


def test_it_reads_the_text_part_of_a_multimodal_config():
    text = llama(model_type="gemma3_text", torch_dtype=None)
    config = {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "model_type": "gemma3",
        "text_config": text,
        "vision_config": {"hidden_size": 1152, "num_hidden_layers": 27, "num_attention_heads": 16},
        "torch_dtype": "bfloat16",
    }
    arch = arch_from_config(config)
    assert (arch.model_type, arch.num_layers, arch.hidden_size, arch.weight_dtype) == (
        "gemma3_text",
        4,
        256,
        "bfloat16",
    )


def test_it_fills_gemma3_text_defaults_that_hub_configs_omit():
    # The shape of google/gemma-3-27b-it's config.json: no vocab_size or
    # max_position_embeddings in text_config (they are Gemma3TextConfig defaults).
    config = {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "model_type": "gemma3",
        "text_config": {
            "head_dim": 128,
            "hidden_size": 5376,
            "intermediate_size": 21504,
            "model_type": "gemma3_text",
            "num_attention_heads": 32,
            "num_hidden_layers": 62,
            "num_key_value_heads": 16,
        },
        "torch_dtype": "bfloat16",
    }
    arch = arch_from_config(config)
    assert (arch.vocab_size, arch.max_position_embeddings, arch.tie_word_embeddings) == (
        262_208,
        131_072,
        True,
    )


def test_it_names_the_nested_field_in_errors():
    config = {"model_type": "llava", "text_config": llama(hidden_size=None)}
    assert field_of(config) == "text_config.hidden_size"


# --- bad input ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "key",
    [
        "num_hidden_layers",
        "hidden_size",
        "num_attention_heads",
        "intermediate_size",
        "vocab_size",
        "max_position_embeddings",
        "model_type",
    ],
)
def test_it_names_a_missing_required_field(key):
    assert field_of(llama(**{key: None})) == key


def test_it_says_a_missing_field_is_missing():
    with pytest.raises(InputError, match=r"num_attention_heads: missing from config\.json"):
        arch_from_config(llama(num_attention_heads=None))


@pytest.mark.parametrize("value", ["32", True, 0, -4, 4.0, [4]])
def test_it_rejects_a_layer_count_that_is_not_a_positive_integer(value):
    assert field_of(llama(num_hidden_layers=value)) == "num_hidden_layers"


def test_it_rejects_heads_that_do_not_divide_hidden_without_head_dim():
    assert field_of(llama(num_attention_heads=6, num_key_value_heads=None)) == "num_attention_heads"


def test_it_rejects_kv_heads_that_do_not_divide_attention_heads():
    assert field_of(llama(num_key_value_heads=3)) == "num_key_value_heads"


def test_it_rejects_a_non_boolean_tie_word_embeddings():
    assert field_of(llama(tie_word_embeddings="false")) == "tie_word_embeddings"


def test_it_rejects_an_unknown_weight_dtype():
    assert field_of(llama(torch_dtype="int3")) == "torch_dtype"


def test_it_rejects_a_quantization_config_without_a_method():
    assert field_of(llama(quantization_config={"bits": 4})) == "quantization_config.quant_method"


def test_it_rejects_string_quant_bits():
    config = llama(quantization_config={"quant_method": "gptq", "bits": "4"})
    assert field_of(config) == "quantization_config.bits"


def test_it_rejects_a_zero_group_size():
    config = llama(quantization_config={"quant_method": "gptq", "bits": 4, "group_size": 0})
    assert field_of(config) == "quantization_config.group_size"


def test_it_rejects_a_config_that_is_not_an_object():
    assert field_of([LLAMA]) == "config"


def test_it_rejects_a_text_config_that_is_not_an_object():
    assert field_of({"model_type": "llava", "text_config": "llama"}) == "text_config"


# --- files and names ----------------------------------------------------------------


def test_it_loads_a_config_file_by_path(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA))
    assert load_config(path).num_layers == 4


def test_it_loads_the_config_in_a_model_directory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    assert load_config(tmp_path).num_kv_heads == 2


def test_it_reports_a_missing_file_as_config_not_found(tmp_path):
    with pytest.raises(InputError, match="not found") as caught:
        load_config(tmp_path / "nope" / "config.json")
    assert caught.value.field == "config"


def test_it_reports_a_directory_without_config_json(tmp_path):
    with pytest.raises(InputError, match="not found") as caught:
        load_config(tmp_path)
    assert caught.value.field == "config"


def test_it_rejects_a_file_that_is_not_json(tmp_path):
    path = tmp_path / "config.json"
    path.write_text("{'model_type': 'llama'")
    with pytest.raises(InputError, match="not valid JSON") as caught:
        load_config(path)
    assert caught.value.field == "config"


def test_it_rejects_a_file_that_is_not_utf8(tmp_path):
    path = tmp_path / "config.json"
    path.write_bytes(b"\xff\xfe\x00{")
    with pytest.raises(InputError) as caught:
        load_config(path)
    assert caught.value.field == "config"


def test_it_rejects_json_that_is_not_an_object(tmp_path):
    path = tmp_path / "config.json"
    path.write_text("[1, 2, 3]")
    with pytest.raises(InputError, match="must be a JSON object") as caught:
        load_config(path)
    assert caught.value.field == "config"


def test_it_resolves_a_path_that_is_not_a_bundled_name(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(llama(num_hidden_layers=7)))
    assert resolve_model_config(str(tmp_path)).num_layers == 7


def test_it_lists_the_known_names_for_an_unknown_model():
    with pytest.raises(InputError, match="known: gemma-2-27b-it-gptq-4bit, llama-2-13b-chat-hf") as caught:
        resolve_model_config("llama-9-1t")
    assert caught.value.field == "model"
