"""The simulated engine: a model × profile on a TP group of catalog GPUs.

`SimEngine` owns the KV cache (capacity from the planner), the scheduler and
the step-cost model. A driver calls `schedule()`, waits `step_time(plan)`
seconds (really in the server, virtually in the sweep), then `finish(plan)`.

`check_startup` refuses at start what vLLM would refuse on that GPU, with
messages worded like vLLM's (bf16 below sm_80, AWQ below sm_75, a KV cache
smaller than one max-length sequence, weights that do not fit, a TP size that
does not divide the heads), so a launch against the simulator fails the way
a launch against vLLM would.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from inference.engines import attention_slowdown
from inference.hardware import GpuSpec
from inference.modelspec import ModelArch
from inference.planner import GB, Placement, Plan, Sizing, plan_deployment
from inference.profile import ProfileSettings
from inference.rules import tp_is_valid
from inference.sim.costs import DEFAULT_HOST_COSTS, HostCosts, StepCostModel, StepTime
from inference.sim.kv_cache import KVCache
from inference.sim.scheduler import Scheduler, SimRequest, StepOutcome, StepPlan


class EngineRefused(Exception):
    """The engine would not start; the message reads like vLLM's."""


@dataclass(frozen=True)
class EngineConfig:
    model: ModelArch
    profile: ProfileSettings
    gpu: GpuSpec
    nvlink: bool | None = None  # None: SXM boards are NVLinked, PCIe cards are not
    host: HostCosts = DEFAULT_HOST_COSTS  # the node's calibrated host costs, or the defaults
    # The node's vLLM version ("": unknown): a V1 line on Volta runs a slower attention path.
    engine_version: str = ""

    @property
    def placement(self) -> Placement:
        tp = self.profile.tensor_parallel_size
        nvlink = self.nvlink
        if nvlink is None and tp > 1:
            nvlink = self.gpu.nvlink_gb_s is not None
        return Placement(
            gpu=self.gpu,
            gpu_count=tp,
            nvlink_connected=nvlink if tp > 1 else None,
            engine_version=self.engine_version,
        )


def _vllm_message(code: str, config: EngineConfig, sizing: Sizing, fallback: str) -> str:
    gpu, model, profile = config.gpu, config.model, config.profile
    major, minor = gpu.cc_tuple
    name = gpu.nvidia_smi_names[0] if gpu.nvidia_smi_names else gpu.display_name
    if code == "bf16_unsupported":
        return (
            "Bfloat16 is only supported on GPUs with compute capability of at least 8.0. "
            f"Your {name} GPU has compute capability {major}.{minor}. You can use float16 instead "
            "by explicitly setting the `dtype` flag in CLI, for example: --dtype=half."
        )
    if code in ("awq_unsupported", "quantization_unsupported"):
        method = profile.quantization or (model.quantization or "").removesuffix("_marlin")
        from inference.rules import QUANT_MIN_CAPABILITY

        needed = QUANT_MIN_CAPABILITY.get(method, (0, 0))
        return (
            f"The quantization method {method} is not supported for the current GPU. Minimum "
            f"capability: {needed[0]}{needed[1]}. Current capability: {major}{minor}."
        )
    if code == "quantization_mismatch":
        return (
            f"Quantization method specified in the model config ({model.quantization}) does not "
            f"match the quantization method specified in the `quantization` argument "
            f"({profile.quantization})."
        )
    if code == "tp_not_divisor":
        if model.num_attention_heads % profile.tensor_parallel_size:
            return (
                f"Total number of attention heads ({model.num_attention_heads}) must be divisible "
                f"by tensor parallel size ({profile.tensor_parallel_size})."
            )
        return (
            f"Total number of key-value heads ({model.num_kv_heads}) and tensor parallel size "
            f"({profile.tensor_parallel_size}) must divide each other."
        )
    if code == "max_model_len_exceeds_positions":
        return (
            f"User-specified max_model_len ({sizing.max_model_len}) is greater than the derived "
            f"max_model_len (max_position_embeddings={model.max_position_embeddings} or model_max_length"
            "=None in model's config.json). This may lead to incorrect model outputs or CUDA errors."
        )
    if code == "batched_tokens_below_max_len":
        return (
            f"max_num_batched_tokens ({sizing.max_num_batched_tokens}) is smaller than max_model_len "
            f"({sizing.max_model_len}). This effectively limits the maximum sequence length to "
            "max_num_batched_tokens and makes vLLM reject longer sequences. Please increase "
            "max_num_batched_tokens or decrease max_model_len."
        )
    if code == "weights_do_not_fit":
        return (
            "CUDA out of memory while loading the model: the weights need "
            f"{sizing.weights_bytes_per_gpu / 2**30:.2f} GiB per GPU and "
            f"{gpu.memory_gib * profile.gpu_memory_utilization:.2f} GiB is allowed "
            f"(gpu_memory_utilization={profile.gpu_memory_utilization}). {fallback}"
        )
    if code == "kv_cache_too_small":
        needed_gib = sizing.max_model_len * sizing.kv_bytes_per_token_per_gpu / 2**30
        available = max(0.0, sizing.kv_budget_bytes_per_gpu) / 2**30
        if sizing.kv_cache_tokens == 0:
            return (
                "No available memory for the cache blocks. Try increasing `gpu_memory_utilization` "
                "when initializing the engine."
            )
        return (
            f"To serve at least one request with the models's max seq len ({sizing.max_model_len}), "
            f"({needed_gib:.2f} GiB KV cache is needed, which is larger than the available KV cache "
            f"memory ({available:.2f} GiB). Based on the available memory, the estimated maximum "
            f"model length is {sizing.kv_cache_tokens}. Try increasing `gpu_memory_utilization` or "
            "decreasing `max_model_len` when initializing the engine."
        )
    return fallback


# What the planner's rules say vLLM does not support on Volta (inference/rules.py, from vLLM's
# feature × hardware table): the simulator of a Volta GPU runs without them, as the rules advise,
# and says so at start. The flag, and the finding that explains it.
VOLTA_UNSUPPORTED = {
    "enable_chunked_prefill": "chunked_prefill_on_volta",
    "enable_prefix_caching": "prefix_caching_on_volta",
}


def supported_profile(profile: ProfileSettings, gpu: GpuSpec) -> tuple[ProfileSettings, list[str]]:
    """The profile the simulated engine runs on `gpu`, and the flags it ignored (Volta only)."""
    if not gpu.is_volta:
        return profile, []
    ignored = [flag for flag in VOLTA_UNSUPPORTED if getattr(profile, flag)]
    overrides: dict[str, Any] = dict.fromkeys(ignored, False)
    return replace(profile, **overrides), ignored


def check_startup(config: EngineConfig) -> Plan:
    """The planner's plan, or EngineRefused with vLLM's wording for the first error."""
    plan = plan_deployment(config.model, config.profile, config.placement)
    errors = [finding for finding in plan.findings if finding.level == "error"]
    if errors:
        sizing = Sizing(config.model, config.profile, config.gpu)
        first = errors[0]
        raise EngineRefused(_vllm_message(first.code, config, sizing, first.message))
    if not tp_is_valid(config.model, config.profile.tensor_parallel_size):  # pragma: no cover - a rule
        raise EngineRefused("tensor parallel size does not divide the model's heads")
    return plan


class SimEngine:
    """The scheduler, KV cache and step costs of one simulated deployment."""

    def __init__(self, config: EngineConfig) -> None:
        profile, self.ignored_flags = supported_profile(config.profile, config.gpu)
        config = replace(config, profile=profile)
        self.config = config
        self.plan = check_startup(config)
        profile = config.profile
        self.block_size = profile.block_size
        self.max_model_len = self.plan.max_model_len
        self.num_blocks = self.plan.kv_cache_tokens // profile.block_size
        self.kv = KVCache(
            self.num_blocks, profile.block_size, enable_prefix_caching=profile.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            kv_cache=self.kv,
            max_num_seqs=profile.max_num_seqs,
            max_num_batched_tokens=self.plan.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            enable_chunked_prefill=profile.enable_chunked_prefill,
        )
        self.costs = StepCostModel(
            config.model,
            profile,
            config.gpu,
            nvlink=config.placement.nvlink_connected,
            host=config.host,
            attention_slowdown=attention_slowdown(config.engine_version, config.gpu.cc_tuple),
        )

    def warnings(self) -> list[str]:
        """What the engine says at start about flags it ignores (the planner's findings)."""
        return [
            f"--{flag.replace('_', '-')} ignored on {self.config.gpu.display_name}: vLLM's feature × "
            f"hardware table marks it unsupported on Volta (planner finding {VOLTA_UNSUPPORTED[flag]})"
            for flag in self.ignored_flags
        ]

    def describe(self) -> str:
        plan = self.plan
        return (
            f"{self.config.gpu.display_name} x{self.config.profile.tensor_parallel_size}: weights "
            f"{plan.weights_gb_per_gpu:.2f} GB/GPU, KV cache {plan.kv_cache_tokens:,} tokens "
            f"({self.num_blocks:,} blocks of {self.block_size}, {plan.kv_cache_gb_per_gpu:.2f} GB/GPU), "
            f"max_num_batched_tokens {plan.max_num_batched_tokens}, max_model_len {plan.max_model_len}"
        )

    def validate_request(self, prompt_tokens: int, max_tokens: int | None) -> str | None:
        """vLLM's request-length check, or None when the request is acceptable."""
        if prompt_tokens < 1:
            return "The prompt cannot be empty."
        if prompt_tokens >= self.max_model_len:
            return (
                f"This model's maximum context length is {self.max_model_len} tokens. However, your "
                f"request has {prompt_tokens} input tokens. Please reduce the length of the input messages."
            )
        if max_tokens is not None and prompt_tokens + max_tokens > self.max_model_len:
            return (
                f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                f"requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, "
                f"{max_tokens} in the completion). Please reduce the length of the messages or completion."
            )
        return None

    def add(self, request: SimRequest) -> None:
        self.scheduler.add(request)

    def abort(self, request: SimRequest) -> None:
        self.scheduler.abort(request)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def schedule(self) -> StepPlan:
        return self.scheduler.schedule()

    def step_time(self, plan: StepPlan) -> StepTime:
        return self.costs.batch_time(plan.batch())

    def finish(self, plan: StepPlan) -> StepOutcome:
        return self.scheduler.finish_step(plan)


__all__ = ["GB", "EngineConfig", "EngineRefused", "SimEngine", "check_startup"]
