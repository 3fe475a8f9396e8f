"""Read a Hugging Face `config.json` into a `ModelArch`.

The planner needs the shapes of a model (layers, heads, sizes) and how its weights
are stored (dtype, quantization). Those come from the model's `config.json`; this
module turns that file into a `ModelArch` and refuses anything it cannot read with
an `InputError` naming the offending key, never a KeyError or TypeError traceback.

A few architecture configs (no weights) are bundled under `inference/data/hf_configs`
for the demo registry and the tests; `resolve_model_config` accepts their names as
well as paths.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from inference.errors import InputError
from inference.modelspec import ModelArch

BUNDLED_CONFIGS_DIR = Path(__file__).parent / "data" / "hf_configs"

# transformers' per-family default for `tie_word_embeddings` when a config leaves it
# out. Gemma ties its input embeddings to the LM head; Llama, Mistral and Qwen2 do
# not. Unknown families are treated as untied: that counts the LM head separately,
# which overestimates memory rather than underestimating it.
_TIED_BY_DEFAULT = {"gemma", "gemma2", "gemma3", "gemma3_text"}

# Qwen2's attention always has q/k/v biases; its config has no `attention_bias` key
# to say so (Llama-style configs do, and that key is honoured for them).
_ALWAYS_ATTENTION_BIAS = {"qwen2"}

# Hub configs for Gemma 3 omit keys that equal transformers' Gemma3TextConfig
# defaults (the 27B text_config has no vocab_size or max_position_embeddings), so
# a strict reader would reject real Gemma 3 configs. These are those defaults.
_FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma3_text": {
        "vocab_size": 262_208,
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "num_hidden_layers": 26,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "max_position_embeddings": 131_072,
    },
}

# Spellings of weight dtypes seen in config.json files (torch names, short names,
# and the "torch.float16" form some exporters write) mapped to vLLM's names.
_DTYPE_ALIASES = {
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
}
_DEFAULT_DTYPE = "float16"


def arch_from_config(config: dict[str, Any]) -> ModelArch:
    """Build a `ModelArch` from a parsed config.json.

    Multimodal configs (Gemma 3, LLaVA, …) nest the language model under
    `text_config`; its shapes are what the planner needs, so that part is read,
    with dtype and quantization still taken from the top level when the text part
    does not set them.
    """
    if not isinstance(config, dict):
        raise InputError("config", f"must be a JSON object, got {_json_type(config)}")

    text = config
    prefix = ""
    if "text_config" in config:
        text = config["text_config"]
        prefix = "text_config."
        if not isinstance(text, dict):
            raise InputError("text_config", f"must be a JSON object, got {_json_type(text)}")

    model_type = text.get("model_type", config.get("model_type"))
    if model_type is None:
        raise InputError(f"{prefix}model_type", "missing from config.json")
    if not isinstance(model_type, str) or not model_type:
        raise InputError(f"{prefix}model_type", f"must be a non-empty string, got {model_type!r}")
    model_type = model_type.lower()
    reader = _Reader(text, prefix, _FAMILY_DEFAULTS.get(model_type, {}))

    num_layers = reader.positive_int("num_hidden_layers")
    hidden_size = reader.positive_int("hidden_size")
    num_heads = reader.positive_int("num_attention_heads")
    num_kv_heads = reader.positive_int("num_key_value_heads", default=num_heads)
    if num_heads % num_kv_heads != 0:
        raise InputError(
            f"{prefix}num_key_value_heads",
            f"{num_kv_heads} does not divide num_attention_heads ({num_heads})",
        )
    head_dim = reader.positive_int("head_dim", default=None)
    if head_dim is None:
        if hidden_size % num_heads != 0:
            raise InputError(
                f"{prefix}num_attention_heads",
                f"{num_heads} does not divide hidden_size ({hidden_size}) and there is no head_dim",
            )
        head_dim = hidden_size // num_heads

    tie = reader.boolean("tie_word_embeddings", default=model_type in _TIED_BY_DEFAULT)
    if model_type in _ALWAYS_ATTENTION_BIAS:
        attention_bias = True
    else:
        attention_bias = reader.boolean("attention_bias", default=False)

    quantization, quant_bits, quant_group_size = _quantization(config, text, prefix)
    return ModelArch(
        model_type=model_type,
        num_layers=num_layers,
        hidden_size=hidden_size,
        num_attention_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        intermediate_size=reader.positive_int("intermediate_size"),
        vocab_size=reader.positive_int("vocab_size"),
        tie_word_embeddings=tie,
        max_position_embeddings=reader.positive_int("max_position_embeddings"),
        weight_dtype=_weight_dtype(config, text, prefix),
        quantization=quantization,
        quant_bits=quant_bits,
        quant_group_size=quant_group_size,
        attention_bias=attention_bias,
    )


def load_config(path: str | Path) -> ModelArch:
    """Read a config.json file, or the config.json inside a model directory."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise InputError("config", f"{path} not found")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InputError("config", f"cannot read {path}: {e}") from e
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise InputError("config", f"{path} is not valid JSON: {e.msg} at line {e.lineno}") from e
    return arch_from_config(data)


def known_configs() -> dict[str, Path]:
    """The bundled architecture configs, by directory name, sorted by name."""
    return {p.parent.name: p for p in sorted(BUNDLED_CONFIGS_DIR.glob("*/config.json"))}


def resolve_model_config(name_or_path: str) -> ModelArch:
    """Load a bundled config by name, or a config.json / model directory by path.

    Bundled names win over same-named paths so that a registry entry means the same
    model whatever the current directory is.
    """
    known = known_configs()
    if name_or_path in known:
        return load_config(known[name_or_path])
    if name_or_path and Path(name_or_path).exists():
        return load_config(name_or_path)
    raise InputError(
        "model",
        f"{name_or_path!r} is neither a path to a config.json nor a bundled config; "
        f"known: {', '.join(known)}",
    )


class _Reader:
    """Typed access to one level of a config, naming keys as the user sees them."""

    def __init__(self, data: dict[str, Any], prefix: str, defaults: dict[str, Any]) -> None:
        self.data = data
        self.prefix = prefix
        self.defaults = defaults

    def _get(self, key: str) -> Any:
        value = self.data.get(key)
        return self.defaults.get(key) if value is None else value

    def positive_int(self, key: str, default: Any = ...) -> Any:
        value = self._get(key)
        if value is None:
            if default is ...:
                raise InputError(self.prefix + key, "missing from config.json")
            return default
        if not _is_positive_int(value):
            raise InputError(self.prefix + key, f"must be a positive integer, got {value!r}")
        return value

    def boolean(self, key: str, default: bool) -> bool:
        value = self._get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise InputError(self.prefix + key, f"must be true or false, got {value!r}")
        return value


def _weight_dtype(config: dict[str, Any], text: dict[str, Any], prefix: str) -> str:
    # transformers >= 4.56 writes `dtype`; older versions wrote `torch_dtype`.
    for source, source_prefix in ((text, prefix), (config, "")):
        for key in ("dtype", "torch_dtype"):
            value = source.get(key)
            if value is None:
                continue
            name = value.removeprefix("torch.").lower() if isinstance(value, str) else None
            if name not in _DTYPE_ALIASES:
                raise InputError(
                    source_prefix + key,
                    f"unknown weight dtype {value!r}; expected one of float16, bfloat16, float32",
                )
            return _DTYPE_ALIASES[name]
    return _DEFAULT_DTYPE


def _quantization(
    config: dict[str, Any], text: dict[str, Any], prefix: str
) -> tuple[str | None, int | None, int | None]:
    """(method, bits, group size) from `quantization_config`, or all None."""
    if text.get("quantization_config") is not None:
        quant, field = text["quantization_config"], prefix + "quantization_config"
    else:
        quant, field = config.get("quantization_config"), "quantization_config"
    if quant is None:
        return None, None, None
    if not isinstance(quant, dict):
        raise InputError(field, f"must be a JSON object, got {_json_type(quant)}")
    method = quant.get("quant_method")
    if not isinstance(method, str) or not method:
        raise InputError(f"{field}.quant_method", "missing from config.json")
    method = method.lower()

    bits: Any = quant.get("bits", quant.get("w_bit"))  # w_bit/q_group_size: older AutoAWQ
    group_size: Any = quant.get("group_size", quant.get("q_group_size"))
    if method == "compressed-tensors" and bits is None:
        bits, group_size = _compressed_tensors_weights(quant)
    elif method == "bitsandbytes" and bits is None:
        bits = 4 if quant.get("load_in_4bit") else 8 if quant.get("load_in_8bit") else None
    elif method == "fp8" and bits is None:
        bits = 8

    if bits is not None and not _is_positive_int(bits):
        raise InputError(f"{field}.bits", f"must be a positive integer, got {bits!r}")
    if isinstance(group_size, int) and group_size == -1:  # GPTQ/AWQ write -1 for one scale per output channel
        group_size = None
    if group_size is not None and not _is_positive_int(group_size):
        raise InputError(f"{field}.group_size", f"must be a positive integer or -1, got {group_size!r}")
    return method, bits, group_size


def _compressed_tensors_weights(quant: dict[str, Any]) -> tuple[Any, Any]:
    """Bits and group size of the first weight scheme of a compressed-tensors config.

    llm-compressor writes these under config_groups.<group>.weights rather than at
    the top level; a config with several groups is summarised by its first.
    """
    groups = quant.get("config_groups")
    if not isinstance(groups, dict):
        return None, None
    for group in groups.values():
        weights = group.get("weights") if isinstance(group, dict) else None
        if isinstance(weights, dict):
            group_size = weights.get("group_size")
            if weights.get("strategy") == "channel":
                group_size = None
            return weights.get("num_bits"), group_size
    return None, None


def _is_positive_int(value: Any) -> bool:
    # bool is a subclass of int in Python; `true` is never a layer count.
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _json_type(value: Any) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
    for kind, name in names.items():
        if type(value) is kind:
            return name
    return "a number" if isinstance(value, int | float) else type(value).__name__
