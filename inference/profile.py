"""A deployment's launch settings: the one record of vLLM's knobs, each with its flag and bounds.

`ProfileSettings` lists every knob once (`knob(default, flag, Write…)`); the planner sizes a
profile, the rules judge it, `vllm_args` writes its command line and the portal's profile row,
forms and API read the same list (`launch_knobs`). A ProfileSettings that exists is well-formed:
values vLLM could never accept raise InputError on construction.
"""

from __future__ import annotations

import enum
import math
from dataclasses import Field, dataclass, field, fields
from typing import Any

from inference.errors import InputError
from inference.modelspec import ModelArch

# What vLLM's --dtype and --kv-cache-dtype accept (we leave out the aliases
# "half"/"float" so a profile has one spelling per choice).
DTYPES = ("auto", "float16", "bfloat16", "float32")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
# vLLM's --block-size choices on CUDA.
BLOCK_SIZES = (8, 16, 32, 64, 128)

# Default storage of each quantization method vLLM can be told to use:
# (bits per weight, weights per group sharing a scale; 0 = no per-group scales).
# GPTQ/AWQ checkpoints are overwhelmingly 4-bit with group size 128; fp8 keeps
# one scale per tensor or channel, which is negligible. The *_marlin names are
# kernel choices over the same GPTQ/AWQ checkpoints.
QUANT_STORAGE: dict[str, tuple[int, int]] = {
    "gptq": (4, 128),
    "gptq_marlin": (4, 128),
    "awq": (4, 128),
    "awq_marlin": (4, 128),
    "fp8": (8, 0),
}

# Bounds past which a value is a typo, not a plan.
MAX_MODEL_LEN_LIMIT = 10_000_000
MAX_TENSOR_PARALLEL = 64  # vLLM TP stays within one NVLink domain; 64 is already generous
MAX_NUM_SEQS_LIMIT = 65_536
MAX_SWAP_SPACE_GB = 1024  # CPU swap per GPU; more than a node's RAM
MAX_GPU_COUNT = 4096

# Without chunked prefill vLLM must schedule a whole max-length prompt in one
# step, so its token budget is at least max_model_len; with chunked prefill the
# budget is vLLM's default chunk of 2048 tokens.
DEFAULT_BATCHED_TOKENS = 2048


def check_int(name: str, value: object, high: int) -> None:
    """A whole number from 1 to `high`, or InputError naming the field."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputError(name, f"must be a whole number, got {value!r}")
    if value < 1:
        raise InputError(name, f"must be positive, got {value}")
    if value > high:
        raise InputError(name, f"{value:,} is absurd; the limit is {high:,}")


def check_number(name: str, value: object) -> None:
    """A real number (not a bool, not NaN), or InputError naming the field."""
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
        raise InputError(name, f"must be a number, got {value!r}")


def check_choice(name: str, value: object, choices: tuple[Any, ...]) -> None:
    """One of `choices`, or InputError listing them."""
    if value not in choices:
        known = ", ".join(str(choice) for choice in choices)
        raise InputError(name, f"unknown value {value!r}; choose one of: {known}")


class Write(enum.Enum):
    """When `vllm_args` writes a knob's flag (docs/decisions.md, "One record from profile to argv")."""

    ALWAYS = "always"  # `--flag value`, even at vLLM's default: the command line reads as the recipe
    WHEN_SET = "when_set"  # `--flag value` unless the value is None or blank (vLLM decides then)
    UNLESS_DEFAULT = "unless_default"  # only when it differs from the knob's default (a flag vLLM dropped)
    WHEN_TRUE = "when_true"  # a bare `--flag` when true, nothing when false
    BOTH_WAYS = "both_ways"  # `--flag` or `--no-flag`: vLLM's default for it changed across versions


@dataclass(frozen=True)
class Knob:
    """A launch setting as vLLM's command line spells it."""

    flag: str
    write: Write = Write.ALWAYS
    aliases: tuple[str, ...] = ()  # vLLM's short spellings (the simulator's parser takes them too)
    choices: tuple[Any, ...] | None = None
    engine_default: str | None = None  # vLLM's own default where it differs from the portal's
    help: str = ""


def knob(default: Any, flag: str, write: Write = Write.ALWAYS, **details: Any) -> Any:
    """A ProfileSettings field that is a launch knob: its default and its Knob."""
    return field(default=default, metadata={"knob": Knob(flag, write, **details)})


def knob_type(spec: Field[Any]) -> tuple[str, bool]:
    """A knob's value type by name ("int", "float", "str" or "bool") and whether it may be None."""
    kind = spec.type if isinstance(spec.type, str) else spec.type.__name__
    return kind.removesuffix(" | None"), kind.endswith(" | None")


def launch_knobs() -> list[tuple[Field[Any], Knob]]:
    """Every launch knob, in ProfileSettings' order: the one list the other doors read."""
    return [(f, f.metadata["knob"]) for f in fields(ProfileSettings)]


@dataclass(frozen=True)
class ProfileSettings:
    """The launch settings of one deployment, as vLLM's flags name them.

    Values that vLLM could never accept raise InputError on construction, so a
    ProfileSettings that exists is well-formed; what is wrong only for a given
    model or GPU is reported by the rules as findings.
    """

    # The launch knobs, listed once: each names its vLLM flag and when `vllm_args` writes it (Write),
    # in the order the command line shows them. The argv, the simulator's parser and the planner API
    # read this list; a new knob needs only its line here and DeploymentProfile's column
    # (tests/deployments/test_launch_settings.py names any door that does not follow).
    dtype: str = knob("float16", "--dtype", engine_default="auto")
    tensor_parallel_size: int = knob(1, "--tensor-parallel-size", aliases=("-tp",))
    gpu_memory_utilization: float = knob(0.9, "--gpu-memory-utilization")
    max_num_seqs: int = knob(256, "--max-num-seqs")
    block_size: int = knob(16, "--block-size", choices=BLOCK_SIZES)
    max_model_len: int | None = knob(None, "--max-model-len", Write.WHEN_SET)  # None: the model's positions
    # None: see resolved_batched_tokens
    max_num_batched_tokens: int | None = knob(None, "--max-num-batched-tokens", Write.WHEN_SET)
    enable_prefix_caching: bool = knob(
        False, "--enable-prefix-caching", Write.BOTH_WAYS, help="reuse KV blocks of shared prompt prefixes"
    )
    enable_chunked_prefill: bool = knob(
        False, "--enable-chunked-prefill", Write.BOTH_WAYS,
        help="cut long prompts into chunks interleaved with decodes",
    )  # fmt: skip
    enforce_eager: bool = knob(
        False, "--enforce-eager", Write.WHEN_TRUE, help="no CUDA graphs (the safe default on Volta)"
    )
    quantization: str | None = knob(None, "--quantization", Write.WHEN_SET, aliases=("-q",))
    kv_cache_dtype: str = knob("auto", "--kv-cache-dtype", Write.UNLESS_DEFAULT)
    swap_space_gb: float = knob(4.0, "--swap-space", Write.UNLESS_DEFAULT)

    def __post_init__(self) -> None:
        check_choice("dtype", self.dtype, DTYPES)
        check_choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        check_choice("block_size", self.block_size, BLOCK_SIZES)
        if self.quantization is not None:
            check_choice("quantization", self.quantization, tuple(QUANT_STORAGE))
        check_int("tensor_parallel_size", self.tensor_parallel_size, MAX_TENSOR_PARALLEL)
        check_int("max_num_seqs", self.max_num_seqs, MAX_NUM_SEQS_LIMIT)
        if self.max_model_len is not None:
            check_int("max_model_len", self.max_model_len, MAX_MODEL_LEN_LIMIT)
        if self.max_num_batched_tokens is not None:
            check_int("max_num_batched_tokens", self.max_num_batched_tokens, MAX_MODEL_LEN_LIMIT)
        check_number("gpu_memory_utilization", self.gpu_memory_utilization)
        check_number("swap_space_gb", self.swap_space_gb)
        if not 0 < self.gpu_memory_utilization <= 1:
            raise InputError(
                "gpu_memory_utilization",
                f"must be a fraction in (0, 1], got {self.gpu_memory_utilization}",
            )
        if not 0 <= self.swap_space_gb <= MAX_SWAP_SPACE_GB:
            raise InputError(
                "swap_space_gb", f"must be between 0 and {MAX_SWAP_SPACE_GB}, got {self.swap_space_gb}"
            )

    def resolved_max_model_len(self, model: ModelArch) -> int:
        return self.max_model_len or model.max_position_embeddings

    def resolved_batched_tokens(self, model: ModelArch) -> int:
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        if self.enable_chunked_prefill:
            return DEFAULT_BATCHED_TOKENS
        return max(self.resolved_max_model_len(model), DEFAULT_BATCHED_TOKENS)
