"""Capacity planning for one vLLM deployment: does it fit, how much KV cache, how fast at best.

`plan_deployment(model, profile, placement)` follows what vLLM does at start-up:
load the weights (sharded over the tensor-parallel group), run one profiling
forward pass of `max_num_batched_tokens`, and give what is left of
`gpu_memory_utilization` x memory to the KV cache. On top of that it states the
rooflines from datasheet peaks (decode is bandwidth-bound, prefill compute-bound)
and asks `inference.rules` what is wrong with the profile.

Reported sizes are decimal GB (1e9 bytes); GPU capacity is `memory_gib` x 2**30.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import Any

from inference.hardware import GpuSpec
from inference.modelspec import DTYPE_BYTES, ModelArch
from inference.profile import MAX_GPU_COUNT, QUANT_STORAGE, ProfileSettings, check_int
from inference.rules import Finding, validate

__all__ = [
    "Finding",
    "Placement",
    "Plan",
    "Sizing",
    "allowance_bytes",
    "kv_cache_bytes_per_token",
    "plan_deployment",
    "serving_dtype",
    "weights_bytes",
]

GB = 1e9

# Memory vLLM needs besides weights and KV cache, per GPU.
# CUDA context, cuBLAS workspace and NCCL buffers are "non-torch" memory that
# vLLM's profiler subtracts; 0.5 GiB is what a V100 context costs in practice.
CUDA_CONTEXT_BYTES = 0.5 * 2**30
# Peak live activations per token of the profiling forward pass: the gate+up
# projection output (2 x intermediate / TP per token) plus about four hidden-size
# buffers (residual, normed input, attention output, q/k/v slices).
ACTIVATION_HIDDEN_BUFFERS = 4
# The sampler's dummy run holds fp32 logits for max_num_seqs rows. They are
# gathered over the whole vocabulary on a rank whose KV budget bounds the whole
# group (vLLM takes the minimum over workers), so they are not divided by TP.
LOGITS_BYTES = 4

# docs/v100-field-guide.md#hardware: 75-85 % of the ~900 GB/s HBM2 peak is reachable; 750 of 900 is the
# figure behind "7B fp16 TP8: 1.75 GB per GPU at 750 GB/s ≈ 2.3 ms".
EFFECTIVE_BANDWIDTH_FRACTION = 750 / 900
# docs/v100-field-guide.md#hardware: "real prefill takes 3-4x the ideal"; the middle of that range.
PREFILL_REALITY_FACTOR = 3.5
# A forward pass costs ~2 FLOPs (multiply + add) per parameter per token.
FLOPS_PER_PARAM_PER_TOKEN = 2


@dataclass(frozen=True)
class Placement:
    """Where a deployment runs: which GPU, how many of them, how they are linked."""

    gpu: GpuSpec
    gpu_count: int = 1  # GPUs available to the deployment
    # True: the TP group is linked by NVLink; False: PCIe only; None: unknown.
    nvlink_connected: bool | None = None
    # What the node's real topology says about these GPUs as one TP group
    # (inference.tp_topology.advise_tp_group); None where no topology is known (catalog GPUs).
    topology_findings: tuple[Finding, ...] | None = None
    # The node's vLLM version as its probe found it ("": unknown; the newest line is assumed).
    engine_version: str = ""

    def __post_init__(self) -> None:
        check_int("gpu_count", self.gpu_count, MAX_GPU_COUNT)


def serving_dtype(model: ModelArch, profile: ProfileSettings, gpu: GpuSpec) -> str:
    """The dtype vLLM computes in (and stores unquantized weights in)."""
    if profile.dtype != "auto":
        return profile.dtype
    if model.weight_dtype == "bfloat16":
        # vLLM serves bf16 checkpoints as float16 where bf16 is unsupported.
        return "bfloat16" if gpu.supports_bf16 else "float16"
    # float32 checkpoints are served in half precision ("common practice" in
    # vLLM's dtype resolution); fp8/int8 storage dtypes compute in half too.
    return "float16"


def weight_quantization(model: ModelArch, profile: ProfileSettings) -> str | None:
    """How the weights are stored in GPU memory."""
    if model.quantization is not None:
        return model.quantization
    # fp8 is the one method vLLM applies on the fly to an unquantized checkpoint.
    return "fp8" if profile.quantization == "fp8" else None


def quantized_bits_per_weight(model: ModelArch, method: str) -> float:
    """Bits per quantized weight, including each group's fp16 scale and b-bit zero point."""
    default_bits, default_group = QUANT_STORAGE.get(method, (8, 0))
    bits = model.quant_bits or default_bits
    group = model.quant_group_size if model.quant_group_size is not None else default_group
    # GPTQ's group_size -1 means one scale per output channel: negligible overhead.
    overhead = (16 + bits) / group if group > 0 else 0
    return bits + overhead


def weights_bytes(model: ModelArch, profile: ProfileSettings, gpu: GpuSpec) -> float:
    """Bytes of the whole model's weights as vLLM holds them (all GPUs together)."""
    method = weight_quantization(model, profile)
    if method is None:
        return model.param_count * DTYPE_BYTES[serving_dtype(model, profile, gpu)]
    # GPTQ/AWQ/fp8 quantize the blocks' linear layers; vLLM keeps the embeddings,
    # lm_head and norms unquantized in half precision by default.
    linear = model.linear_params * quantized_bits_per_weight(model, method) / 8
    rest = (model.param_count - model.linear_params) * DTYPE_BYTES["float16"]
    return linear + rest


def kv_cache_bytes_per_token(model: ModelArch, profile: ProfileSettings, gpu: GpuSpec) -> int:
    """KV cache bytes one token occupies on each GPU of the TP group."""
    if profile.kv_cache_dtype == "auto":
        element_bytes = DTYPE_BYTES[serving_dtype(model, profile, gpu)]
    else:
        element_bytes = DTYPE_BYTES["fp8"]
    # vLLM splits KV heads over the TP group and replicates them when TP exceeds
    # their number, so every GPU holds at least one.
    kv_heads_per_gpu = max(1, math.ceil(model.num_kv_heads / profile.tensor_parallel_size))
    return int(2 * model.num_layers * kv_heads_per_gpu * model.head_dim * element_bytes)


def allowance_bytes(model: ModelArch, profile: ProfileSettings, gpu: GpuSpec) -> float:
    """Memory per GPU held back from the KV cache: CUDA context, activations, logits."""
    tp = profile.tensor_parallel_size
    activation_width = 2 * model.intermediate_size / tp + ACTIVATION_HIDDEN_BUFFERS * model.hidden_size
    activations = (
        profile.resolved_batched_tokens(model)
        * activation_width
        * DTYPE_BYTES[serving_dtype(model, profile, gpu)]
    )
    logits = profile.max_num_seqs * model.vocab_size * LOGITS_BYTES
    return CUDA_CONTEXT_BYTES + activations + logits


def peak_tflops(gpu: GpuSpec, dtype: str) -> float:
    """The datasheet peak for matmuls in `dtype`."""
    if dtype == "float32":
        # Unknown fp32 peak: fall back to fp16 and overstate, as ceilings may.
        return gpu.fp32_tflops or gpu.fp16_tflops
    if dtype == "bfloat16" and gpu.bf16_tflops is not None:
        return gpu.bf16_tflops
    # bf16 on a GPU without it is refused by the rules; fp16 keeps the figure finite.
    return gpu.fp16_tflops


@dataclass(frozen=True)
class Sizing:
    """The arithmetic of one model x profile x GPU, in bytes, at full precision.

    The rules receive it and ask what-if questions (`with_profile`, `with_model`)
    without importing this module.
    """

    model: ModelArch
    profile: ProfileSettings
    gpu: GpuSpec

    def with_profile(self, **changes: Any) -> Sizing:
        return replace(self, profile=replace(self.profile, **changes))

    def with_model(self, **changes: Any) -> Sizing:
        return replace(self, model=replace(self.model, **changes))

    @property
    def tensor_parallel_size(self) -> int:
        return self.profile.tensor_parallel_size

    @property
    def serving_dtype(self) -> str:
        return serving_dtype(self.model, self.profile, self.gpu)

    @property
    def max_model_len(self) -> int:
        return self.profile.resolved_max_model_len(self.model)

    @property
    def max_num_batched_tokens(self) -> int:
        return self.profile.resolved_batched_tokens(self.model)

    @property
    def weights_bytes_total(self) -> float:
        return weights_bytes(self.model, self.profile, self.gpu)

    @property
    def weights_bytes_per_gpu(self) -> float:
        # vLLM shards every linear layer, the vocab embedding and lm_head over TP.
        return self.weights_bytes_total / self.tensor_parallel_size

    @property
    def usable_bytes_per_gpu(self) -> float:
        return self.gpu.memory_bytes * self.profile.gpu_memory_utilization

    @property
    def allowance_bytes_per_gpu(self) -> float:
        return allowance_bytes(self.model, self.profile, self.gpu)

    @property
    def kv_budget_bytes_per_gpu(self) -> float:
        """What is left for the KV cache; negative when the weights do not fit."""
        return self.usable_bytes_per_gpu - self.weights_bytes_per_gpu - self.allowance_bytes_per_gpu

    @property
    def weights_fit(self) -> bool:
        return self.kv_budget_bytes_per_gpu >= 0

    @property
    def kv_bytes_per_token_per_gpu(self) -> int:
        return kv_cache_bytes_per_token(self.model, self.profile, self.gpu)

    @property
    def kv_cache_tokens(self) -> int:
        """KV capacity of the deployment; per GPU equals per group, as heads are split."""
        budget = max(0.0, self.kv_budget_bytes_per_gpu)
        tokens = int(budget // self.kv_bytes_per_token_per_gpu)
        # vLLM allocates whole blocks.
        return tokens - tokens % self.profile.block_size

    @property
    def decode_tokens_per_s_ceiling(self) -> float:
        # Each decode step reads every GPU's weight shard once; the GPUs read in
        # parallel, so one stream's ceiling is peak bandwidth ÷ shard size.
        return self.gpu.bandwidth_gb_s * GB / self.weights_bytes_per_gpu

    @property
    def decode_step_s_at_effective_bandwidth(self) -> float:
        effective = self.gpu.bandwidth_gb_s * GB * EFFECTIVE_BANDWIDTH_FRACTION
        return self.weights_bytes_per_gpu / effective

    def prefill_flops(self, tokens: int) -> float:
        return FLOPS_PER_PARAM_PER_TOKEN * self.model.param_count * tokens

    def prefill_s_ideal(self, tokens: int) -> float:
        group_flops = self.tensor_parallel_size * peak_tflops(self.gpu, self.serving_dtype) * 1e12
        return self.prefill_flops(tokens) / group_flops


@dataclass(frozen=True)
class Plan:
    """What a deployment would look like: sizes, capacity, ceilings and findings."""

    gpu_key: str
    tensor_parallel_size: int
    serving_dtype: str
    max_model_len: int
    max_num_batched_tokens: int
    weights_gb_total: float
    weights_gb_per_gpu: float
    allowance_gb_per_gpu: float
    kv_cache_bytes_per_token_per_gpu: int
    kv_cache_gb_per_gpu: float
    kv_cache_tokens: int
    max_concurrent_seqs_at_max_len: int
    decode_tokens_per_s_ceiling: float
    decode_step_ms_at_effective_bandwidth: float
    prefill_ms_per_1k_tokens_ideal: float
    prefill_ms_per_1k_tokens_expected: float
    findings: tuple[Finding, ...] = field(default=())

    @property
    def ok(self) -> bool:
        return not any(finding.level == "error" for finding in self.findings)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready; floats rounded to 3 decimals for display only."""
        data: dict[str, Any] = {}
        for item in fields(self):
            value = getattr(self, item.name)
            data[item.name] = round(value, 3) if isinstance(value, float) else value
        data["findings"] = [finding.to_dict() for finding in self.findings]
        data["ok"] = self.ok
        return data


def plan_deployment(model: ModelArch, profile: ProfileSettings, placement: Placement) -> Plan:
    """Size a deployment of `model` with `profile` on `placement` and check it."""
    sizing = Sizing(model, profile, placement.gpu)
    return Plan(
        gpu_key=placement.gpu.key,
        tensor_parallel_size=profile.tensor_parallel_size,
        serving_dtype=sizing.serving_dtype,
        max_model_len=sizing.max_model_len,
        max_num_batched_tokens=sizing.max_num_batched_tokens,
        weights_gb_total=sizing.weights_bytes_total / GB,
        weights_gb_per_gpu=sizing.weights_bytes_per_gpu / GB,
        allowance_gb_per_gpu=sizing.allowance_bytes_per_gpu / GB,
        kv_cache_bytes_per_token_per_gpu=sizing.kv_bytes_per_token_per_gpu,
        kv_cache_gb_per_gpu=max(0.0, sizing.kv_budget_bytes_per_gpu) / GB,
        kv_cache_tokens=sizing.kv_cache_tokens,
        max_concurrent_seqs_at_max_len=sizing.kv_cache_tokens // sizing.max_model_len,
        decode_tokens_per_s_ceiling=sizing.decode_tokens_per_s_ceiling,
        decode_step_ms_at_effective_bandwidth=sizing.decode_step_s_at_effective_bandwidth * 1000,
        prefill_ms_per_1k_tokens_ideal=sizing.prefill_s_ideal(1000) * 1000,
        prefill_ms_per_1k_tokens_expected=sizing.prefill_s_ideal(1000) * PREFILL_REALITY_FACTOR * 1000,
        findings=tuple(validate(model, profile, placement, sizing)),
    )
