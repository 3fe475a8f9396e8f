"""What is wrong with a deployment profile, said before vLLM is launched with it.

Each rule looks at one thing and returns a `Finding` or None:
- error: vLLM would refuse to start or serve garbage; the portal must not launch it;
- warning: it starts, but the field notes say it misbehaves (OOM, stalls, preemption);
- info: it works, but there is a better way to spend the GPUs.
Every message says why and what to do instead. The figures come from the
planner's `Sizing`, which this module only imports for typing (the planner
imports this module to attach findings to its plan); the profile is
inference/profile.py's record.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from inference.engines import V1_VOLTA_ATTENTION_SLOWDOWN, EngineGeneration, engine_line
from inference.vllm_args import version_problems

if TYPE_CHECKING:
    from inference.modelspec import ModelArch
    from inference.planner import Placement, Sizing
    from inference.profile import ProfileSettings

_GB = 1e9

LEVELS = ("error", "warning", "info")

# Minimum compute capability of vLLM's quantization kernels: the
# get_min_capability() of each QuantizationConfig (GPTQ 60, AWQ 75, the Marlin
# variants and fp8 80).
QUANT_MIN_CAPABILITY: dict[str, tuple[int, int]] = {
    "gptq": (6, 0),
    "gptq_marlin": (8, 0),
    "awq": (7, 5),
    "awq_marlin": (8, 0),
    "fp8": (8, 0),
}

# docs/v100-field-guide.md#launch-settings: 0.95-0.96 gave CUDA OOM on V100 at load or
# sporadically; 0.93 ran 72 h clean.
VOLTA_SAFE_MEMORY_UTILIZATION = 0.93

# The length a sequence typically reaches in the field mix: prompts average
# ~1250 tokens (40 % ~250, 30 % ~1000, 20 % ~2250, 10 % ~4000) plus ~500 output
# tokens (max_tokens clamped to 1024), ~1750 in all, rounded up to whole blocks.
TYPICAL_SEQ_TOKENS = 2048
# vLLM admits up to max_num_seqs and preempts when their KV does not fit; twice
# the typical capacity leaves room for short requests without preemption storms.
PREEMPTION_FACTOR = 2

# docs/v100-field-guide.md#launch-settings: past 8192 on V100 "the gain is small and KV
# capacity collapses".
VOLTA_USEFUL_MAX_MODEL_LEN = 8192

# docs/v100-field-guide.md#launch-settings: when one GPU holds the weights with ≥ 50 % left
# for KV, run one instance per GPU (or per pair) instead of tensor parallelism.
SMALL_MODEL_KV_SHARE = 0.5

# vLLM's own feature × hardware table (docs/features/README.md, "Feature x Hardware"; before
# 0.10 docs/features/compatibility_matrix.md, first docs/source/serving/compatibility_matrix.rst)
# marks chunked prefill (vllm#2729) and automatic prefix caching (vllm#3687) as not supported
# on Volta. It says so in every version of the table: from its first, in vLLM 0.6.x (0.6.4.post1
# was read), through 0.10.0 to the current docs. Behind both marks is the Triton kernel that
# attends to KV already cached (a later chunk of a prompt, a cached prefix), which failed on
# sm_70 with "mma -> mma layout conversion is only supported on Ampere" (vllm#6723, #8024,
# #11352). docs/v100-field-guide.md#feature-support-on-volta says how to check a node.
VOLTA_UNSUPPORTED_SOURCE = (
    'vLLM\'s feature × hardware table (docs/features/README.md, "Feature x Hardware", vLLM 0.6 '
    "through the current docs)"
)
VOLTA_CHECK = (
    "To check a node's vLLM build: `manage.py accept_node <node> --agent --profile <profile>` (or the "
    "node page's Accept this node with the profile chosen) starts the reference model with this "
    "profile's flags and, before the bench, sends one prompt longer than max_num_batched_tokens and "
    "the same prompt twice; its feature_probe step fails, naming the feature, if the engine dies as "
    "the table says."
)

# Candidate TPs for suggestions: vLLM deployments use powers of two.
_SUGGESTED_TPS = (1, 2, 4, 8, 16, 32, 64)


@dataclass(frozen=True)
class Finding:
    """One thing the planner has to say about a profile."""

    level: str  # "error" | "warning" | "info"
    code: str
    message: str

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


# Short names for the findings, for lists where the full message does not fit (the profiles page).
TITLES = {
    "bf16_unsupported": "no bf16 on this GPU",
    "bf16_weights_auto_dtype": "bf16 weights, dtype auto",
    "bf16_weights_cast_to_fp16": "bf16 weights cast to fp16",
    "awq_unsupported": "AWQ needs sm_75",
    "quantization_unsupported": "quantization kernels missing",
    "quantization_mismatch": "quantization differs from the weights",
    "weights_do_not_fit": "weights do not fit",
    "kv_cache_too_small": "KV cache too small",
    "tp_not_divisor": "invalid tensor-parallel size",
    "tp_exceeds_gpus": "more tensor-parallel ranks than GPUs",
    "tp_over_pcie": "tensor parallel over PCIe",
    "gpu_memory_utilization_high": "GPU memory utilization high",
    "eager_off_on_volta": "eager mode off on Volta",
    "max_num_seqs_preemption": "max sequences above KV room",
    "max_model_len_exceeds_positions": "max length above the model's",
    "tp_for_small_model": "tensor parallel for a small model",
    "long_context_on_volta": "long context on Volta",
    "batched_tokens_below_max_len": "batched tokens below max length",
    "chunked_prefill_on_volta": "chunked prefill on Volta",
    "prefix_caching_on_volta": "prefix caching on Volta",
    "tp_no_nvlink_ring": "no NVLink ring for the TP group",
    "tp_pair_without_nvlink": "TP pair without NVLink",
    "tp_ring_not_mesh": "NVLink ring, not a full mesh",
    "tp_spans_sockets": "TP group spans CPU sockets",
    "tp_link_unknown": "unknown link type",
    "tp_topology_unknown": "GPUs not in the topology",
    "engine_version_lacks_flag": "the node's vLLM lacks a flag",
    "v1_attention_on_volta": "V1 attention on Volta",
    "v0_engine_on_volta": "V0 engine on Volta",
}


def finding_title(code: str) -> str:
    return TITLES.get(code, code.replace("_", " "))


def tp_is_valid(model: ModelArch, tp: int) -> bool:
    """Whether vLLM can split the model's heads over `tp` GPUs."""
    heads_split = model.num_attention_heads % tp == 0
    # KV heads are either split evenly or replicated evenly.
    kv_split = model.num_kv_heads % tp == 0 or tp % model.num_kv_heads == 0
    return heads_split and kv_split


def _base_method(method: str) -> str:
    # gptq_marlin/awq_marlin are faster kernels over the same checkpoints.
    return method.removesuffix("_marlin")


def _smallest_fitting_tp(sizing: Sizing) -> int | None:
    for tp in _SUGGESTED_TPS:
        if tp_is_valid(sizing.model, tp) and sizing.with_profile(tensor_parallel_size=tp).weights_fit:
            return tp
    return None


def _bf16_unsupported(
    model: ModelArch, profile: ProfileSettings, placement: Placement, sizing: Sizing
) -> Finding | None:
    gpu = placement.gpu
    if profile.dtype != "bfloat16" or gpu.supports_bf16:
        return None
    return Finding(
        "error",
        "bf16_unsupported",
        f"{gpu.display_name} ({gpu.sm_arch}) has no bf16; vLLM needs compute capability 8.0 for "
        "--dtype bfloat16. Use --dtype float16.",
    )


def _bf16_weights_auto_dtype(
    model: ModelArch, profile: ProfileSettings, placement: Placement, sizing: Sizing
) -> Finding | None:
    gpu = placement.gpu
    if profile.dtype != "auto" or model.weight_dtype != "bfloat16" or gpu.supports_bf16:
        return None
    return Finding(
        "warning",
        "bf16_weights_auto_dtype",
        f"the checkpoint is bfloat16 and --dtype auto leaves the cast to vLLM on {gpu.display_name} "
        f"({gpu.sm_arch}, no bf16); in the field a bf16 checkpoint on V100 gave garbage tokens with no "
        "startup error. Set --dtype float16 explicitly, smoke-test the output, and consider "
        "converting the weights to float16.",
    )


def _bf16_weights_cast_to_fp16(
    model: ModelArch, profile: ProfileSettings, placement: Placement, sizing: Sizing
) -> Finding | None:
    gpu = placement.gpu
    if profile.dtype != "float16" or model.weight_dtype != "bfloat16" or gpu.supports_bf16:
        return None
    # bf16 keeps float32's exponent range; float16 tops out at 65504, so a cast at
    # load can turn large activations or weights into inf with no error at start.
    return Finding(
        "warning",
        "bf16_weights_cast_to_fp16",
        f"the checkpoint is bfloat16 and {gpu.display_name} ({gpu.sm_arch}) has no bf16, so vLLM casts "
        "it to float16 at load; values beyond float16's range (±65504) become inf and give garbage "
        "with no startup error. Serve a float16 conversion checked for overflow, and smoke-test it.",
    )


def _quantization_unsupported(
    model: ModelArch, profile: ProfileSettings, placement: Placement, sizing: Sizing
) -> Finding | None:
    gpu = placement.gpu
    # An explicit --quantization picks the kernel; from the checkpoint alone vLLM
    # picks the fastest kernel the GPU supports, so only the base method counts.
    if profile.quantization is not None:
        method = profile.quantization
    elif model.quantization is not None:
        method = _base_method(model.quantization)
    else:
        return None
    needed = QUANT_MIN_CAPABILITY.get(method)
    if needed is None or gpu.cc_tuple >= needed:
        return None
    needed_cc = f"{needed[0]}.{needed[1]}"
    base = _base_method(method)
    if base == "awq" and gpu.cc_tuple < QUANT_MIN_CAPABILITY["awq"]:
        return Finding(
            "error",
            "awq_unsupported",
            "vLLM's AWQ kernels need compute capability 7.5 (sm_75); "
            f"{gpu.display_name} is {gpu.compute_capability}. Use a GPTQ build of the model, which runs "
            "on V100 (needs 6.0).",
        )
    if base != method and gpu.cc_tuple >= QUANT_MIN_CAPABILITY[base]:
        instead = f"use --quantization {base}, whose kernels run there"
    else:
        instead = "serve the float16 checkpoint or a GPTQ build (GPTQ needs 6.0)"
    return Finding(
        "error",
        "quantization_unsupported",
        f"vLLM's {method} kernels need compute capability {needed_cc}; {gpu.display_name} is "
        f"{gpu.compute_capability}. Instead, {instead}.",
    )


def _quantization_mismatch(
    model: ModelArch, profile: ProfileSettings, placement: Placement, sizing: Sizing
) -> Finding | None:
    asked = profile.quantization
    if asked is None:
        return None
    stored = model.quantization
    if stored is not None and _base_method(stored) == _base_method(asked):
        return None
    # fp8 is the one method vLLM applies on the fly to an unquantized checkpoint.
    if stored is None and asked == "fp8":
        return None
    return Finding(
        "error",
        "quantization_mismatch",
        f"the profile asks for --quantization {asked} but the model's weights are "
        f"{stored or 'not quantized'}; vLLM refuses to load them. Leave quantization unset "
        f"(vLLM reads it from the checkpoint) or use a {asked} build of the model.",
    )


def _fit_suggestion(profile: ProfileSettings, placement: Placement, sizing: Sizing) -> str:
    options = []
    tp = _smallest_fitting_tp(sizing)
    if tp is not None:
        shortfall = f" (needs {tp} GPUs; the placement has {placement.gpu_count})"
        options.append(f"--tensor-parallel-size {tp}{shortfall if tp > placement.gpu_count else ''}")
    if sizing.model.quantization is None and profile.quantization is None:
        gptq = sizing.with_model(quantization="gptq", quant_bits=4, quant_group_size=128)
        gptq_tp = _smallest_fitting_tp(gptq)
        if gptq_tp is not None:
            options.append(
                f"a 4-bit GPTQ build of the model (~{gptq.weights_bytes_total / _GB:.1f} GB) "
                f"at --tensor-parallel-size {gptq_tp}"
            )
    if not options:
        return "No tensor-parallel size up to 64 fits; use GPUs with more memory."
    return "What fits: " + "; or ".join(options) + "."


def _weights_do_not_fit(
    model: ModelArch, profile: ProfileSettings, placement: Placement, sizing: Sizing
) -> Finding | None:
    if sizing.weights_fit:
        return None
    room = (sizing.usable_bytes_per_gpu - sizing.allowance_bytes_per_gpu) / _GB
    return Finding(
        "error",
        "weights_do_not_fit",
        f"the weights need {sizing.weights_bytes_per_gpu / _GB:.1f} GB per GPU at tensor-parallel size "
        f"{profile.tensor_parallel_size}, but one {placement.gpu.display_name} has {room:.1f} GB at "
        f"gpu_memory_utilization {profile.gpu_memory_utilization} after "
        f"{sizing.allowance_bytes_per_gpu / _GB:.1f} GB for activations and the CUDA context. "
        + _fit_suggestion(profile, placement, sizing),
    )


def _kv_cache_too_small(
    model: ModelArch, profile: ProfileSettings, placement: Placement, sizing: Sizing
) -> Finding | None:
    # When the weights do not fit, that is the error to fix first.
    if not sizing.weights_fit or sizing.kv_cache_tokens >= sizing.max_model_len:
        return None
    tokens = sizing.kv_cache_tokens
    if tokens == 0:
        instead = "Free memory: a higher tensor-parallel size, quantized weights or an fp8 KV cache."
    else:
        instead = (
            f"Set max_model_len to {tokens:,} or less, or free memory (higher tensor-parallel size, "
            "quantized weights, fp8 KV cache)."
        )
    return Finding(
        "error",
        "kv_cache_too_small",
        f"the KV cache holds {tokens:,} tokens, less than one sequence of max_model_len "
        f"{sizing.max_model_len:,}; vLLM refuses to start. {instead}",
    )


def _valid_tps_text(model: ModelArch, gpu_count: int) -> str:
    valid = [tp for tp in range(1, gpu_count + 1) if tp_is_valid(model, tp)]
    return ", ".join(str(tp) for tp in valid)


def _tp_not_divisor(
    model: ModelArch, profile: ProfileSettings, placement: Placement, sizing: Sizing
) -> Finding | None:
    tp = profile.tensor_parallel_size
    if tp_is_valid(model, tp):
        return None
    if model.num_attention_heads % tp:
        why = f"does not divide the model's {model.num_attention_heads} attention heads"
    else:
        why = (
            f"and the model's {model.num_kv_heads} KV heads neither divide each other "
            "(vLLM splits KV heads evenly or replicates them evenly)"
        )
    return Finding(
        "error",
        "tp_not_divisor",
        f"tensor-parallel size {tp} {why}; vLLM refuses it. Valid sizes on "
        f"{placement.gpu_count} GPUs: {_valid_tps_text(model, placement.gpu_count)}.",
    )


def _tp_exceeds_gpus(
    model: ModelArch, profile: ProfileSettings, placement: Placement, sizing: Sizing
) -> Finding | None:
    tp = profile.tensor_parallel_size
    if tp <= placement.gpu_count:
        return None
    return Finding(
        "error",
        "tp_exceeds_gpus",
        f"tensor-parallel size {tp} needs {tp} GPUs but the placement has {placement.gpu_count}. "
        f"Use one of {_valid_tps_text(model, placement.gpu_count)}, or place it on more GPUs.",
    )


def _tp_over_pcie(
    model: ModelArch, profile: ProfileSettings, placement: Placement, sizing: Sizing
) -> Finding | None:
    if profile.tensor_parallel_size == 1 or placement.nvlink_connected is not False:
        return None
    if placement.topology_findings is not None:
        return None  # the node's own topology has said it better (tp_no_nvlink_ring, tp_pair_…)
    return Finding(
        "warning",
        "tp_over_pcie",
        f"tensor-parallel size {profile.tensor_parallel_size} over PCIe (~{placement.gpu.pcie_gb_s:g} GB/s) "
        "all-reduces every layer over the slow link; prefer several single-GPU or TP2 instances, "
        "or place the group on NVLink-connected GPUs (nvidia-smi topo -m shows NV#).",
    )


def _gpu_memory_utilization_high(
    model: ModelArch, profile: ProfileSettings, placement: Placement, sizing: Sizing
) -> Finding | None:
    utilization = profile.gpu_memory_utilization
    if not placement.gpu.is_volta or utilization <= VOLTA_SAFE_MEMORY_UTILIZATION:
        return None
    return Finding(
        "warning",
        "gpu_memory_utilization_high",
        f"gpu_memory_utilization {utilization} on V100: at 0.95-0.96 the field saw CUDA OOM at load "
        f"or sporadically, while {VOLTA_SAFE_MEMORY_UTILIZATION} ran 72 h clean. Use 0.92-0.93.",
    )


def _eager_off_on_volta(
    model: ModelArch, profile: ProfileSettings, placement: Placement, sizing: Sizing
) -> Finding | None:
    if not placement.gpu.is_volta or profile.enforce_eager:
        return None
    return Finding(
        "warning",
        "eager_off_on_volta",
        "CUDA graph capture often fails or stalls the first requests on V100; set enforce_eager "
        "(--enforce-eager), the safe default on Volta, at a cost of ~15-20 % throughput.",
    )


def _max_num_seqs_preemption(
    model: ModelArch, profile: ProfileSettings, placement: Placement, sizing: Sizing
) -> Finding | None:
    if not sizing.weights_fit:
        return None
    typical = min(sizing.max_model_len, TYPICAL_SEQ_TOKENS)
    capacity = sizing.kv_cache_tokens // typical
    if profile.max_num_seqs <= PREEMPTION_FACTOR * capacity:
        return None
    return Finding(
        "warning",
        "max_num_seqs_preemption",
        f"max_num_seqs {profile.max_num_seqs} but the KV cache ({sizing.kv_cache_tokens:,} tokens) has "
        f"room for about {capacity} sequence(s) of {typical:,} tokens; past that vLLM preempts and "
        f"recomputes. Set max_num_seqs to about {max(1, capacity)}, or free KV memory.",
    )


def _max_model_len_exceeds_positions(
    model: ModelArch, profile: ProfileSettings, placement: Placement, sizing: Sizing
) -> Finding | None:
    if sizing.max_model_len <= model.max_position_embeddings:
        return None
    return Finding(
        "error",
        "max_model_len_exceeds_positions",
        f"max_model_len {sizing.max_model_len:,} exceeds the model's "
        f"{model.max_position_embeddings:,} positions; vLLM refuses it. Set max_model_len to "
        f"{model.max_position_embeddings:,} or less.",
    )


def _tp_for_small_model(
    model: ModelArch, profile: ProfileSettings, placement: Placement, sizing: Sizing
) -> Finding | None:
    tp = profile.tensor_parallel_size
    if tp == 1:
        return None
    single = sizing.with_profile(tensor_parallel_size=1)
    kv_share = single.kv_budget_bytes_per_gpu / single.usable_bytes_per_gpu
    if kv_share < SMALL_MODEL_KV_SHARE:
        return None
    return Finding(
        "info",
        "tp_for_small_model",
        f"the weights ({single.weights_bytes_total / _GB:.1f} GB) fit one GPU with {kv_share:.0%} of its "
        f"usable memory left for KV cache; {tp} single-GPU instances (or TP2 pairs) serve more than "
        f"one TP{tp} instance, and one failure does not take all of them down.",
    )


def _long_context_on_volta(
    model: ModelArch, profile: ProfileSettings, placement: Placement, sizing: Sizing
) -> Finding | None:
    if not placement.gpu.is_volta or sizing.max_model_len <= VOLTA_USEFUL_MAX_MODEL_LEN:
        return None
    return Finding(
        "info",
        "long_context_on_volta",
        f"max_model_len {sizing.max_model_len:,} on V100: past {VOLTA_USEFUL_MAX_MODEL_LEN} the gain is "
        "small and the KV cache holds few such sequences. 8192 is the field default; lower it "
        "(e.g. 6144) if preemption storms appear.",
    )


def _batched_tokens_below_max_len(
    model: ModelArch, profile: ProfileSettings, placement: Placement, sizing: Sizing
) -> Finding | None:
    if profile.enable_chunked_prefill or sizing.max_num_batched_tokens >= sizing.max_model_len:
        return None
    if placement.gpu.is_volta:
        # Chunked prefill is no way out on Volta (`_chunked_prefill_on_volta`).
        advice = f"Raise max_num_batched_tokens to at least {sizing.max_model_len:,} or lower max_model_len."
    else:
        advice = "Enable chunked prefill or raise max_num_batched_tokens."
    return Finding(
        "error",
        "batched_tokens_below_max_len",
        f"max_num_batched_tokens {sizing.max_num_batched_tokens:,} is below max_model_len "
        f"{sizing.max_model_len:,}; without chunked prefill vLLM refuses it, since a long prompt "
        f"could never be scheduled. {advice}",
    )


def _chunked_prefill_on_volta(
    model: ModelArch, profile: ProfileSettings, placement: Placement, sizing: Sizing
) -> Finding | None:
    if not placement.gpu.is_volta or not profile.enable_chunked_prefill:
        return None
    return Finding(
        "warning",
        "chunked_prefill_on_volta",
        f"chunked prefill is marked not supported on Volta in {VOLTA_UNSUPPORTED_SOURCE}, "
        "vllm#2729: a prompt's later chunks run a Triton kernel that fails on sm_70. Turn it off "
        "(--no-enable-chunked-prefill) with max_num_batched_tokens ≥ max_model_len. " + VOLTA_CHECK,
    )


def _prefix_caching_on_volta(
    model: ModelArch, profile: ProfileSettings, placement: Placement, sizing: Sizing
) -> Finding | None:
    if not placement.gpu.is_volta or not profile.enable_prefix_caching:
        return None
    return Finding(
        "warning",
        "prefix_caching_on_volta",
        f"automatic prefix caching is marked not supported on Volta in {VOLTA_UNSUPPORTED_SOURCE}, "
        "vllm#3687: a cached prefix is attended by the same Triton kernel that fails on sm_70. "
        "Turn it off (--no-enable-prefix-caching). " + VOLTA_CHECK,
    )


def _engine_version_lacks_flag(
    model: ModelArch, profile: ProfileSettings, placement: Placement, numbers: Sizing
) -> Finding | None:
    """A profile whose command line the node's vLLM version cannot parse (inference/engines.py)."""
    if not placement.engine_version:
        return None
    problems = version_problems(profile, placement.engine_version)
    if not problems:
        return None
    return Finding("error", "engine_version_lacks_flag", "; ".join(problems))


def _attention_path_on_volta(
    model: ModelArch, profile: ProfileSettings, placement: Placement, numbers: Sizing
) -> Finding | None:
    """Which attention the node's vLLM runs on Volta (inference/engines.py): V1 lines have no
    FlashAttention there and fall back to FlexAttention/Triton (vllm#25528, #36357), while the
    simulator's V100 figures come from V0 runs (docs/simulator.md)."""
    if not placement.engine_version or placement.gpu.cc_tuple >= (8, 0):
        return None
    line = engine_line(placement.engine_version)
    if line is None or line.engine_on_volta is None:
        return None  # no sm_70 kernels at all: the launch is refused at the environment step
    if line.engine_on_volta == EngineGeneration.V1:
        return Finding(
            "warning",
            "v1_attention_on_volta",
            f"{line.label()} runs the V1 engine, whose attention on Volta is {line.volta_attention}; "
            "the V100 figures come from the V0 engine, and the simulator charges this path "
            f"{V1_VOLTA_ATTENTION_SLOWDOWN:g}x on attention (reported, not measured on a V100: "
            "docs/simulator.md), so expect slower prefill and decode than on V0. The 0.8.5 line "
            "runs V0 (XFormers) on Volta.",
        )
    return Finding(
        "info",
        "v0_engine_on_volta",
        f"{line.label()} runs the V0 engine on Volta ({line.volta_attention}), the path the "
        "simulator's V100 figures were measured on.",
    )


RULES = (
    _bf16_unsupported,
    _bf16_weights_auto_dtype,
    _bf16_weights_cast_to_fp16,
    _quantization_unsupported,
    _quantization_mismatch,
    _tp_not_divisor,
    _tp_exceeds_gpus,
    _max_model_len_exceeds_positions,
    _batched_tokens_below_max_len,
    _weights_do_not_fit,
    _kv_cache_too_small,
    _tp_over_pcie,
    _gpu_memory_utilization_high,
    _eager_off_on_volta,
    _max_num_seqs_preemption,
    _tp_for_small_model,
    _long_context_on_volta,
    _chunked_prefill_on_volta,
    _prefix_caching_on_volta,
    _engine_version_lacks_flag,
    _attention_path_on_volta,
)


def validate(
    model: ModelArch, profile: ProfileSettings, placement: Placement, numbers: Sizing
) -> list[Finding]:
    """All findings for the profile, errors first."""
    findings = [finding for rule in RULES if (finding := rule(model, profile, placement, numbers))]
    if profile.tensor_parallel_size > 1 and placement.topology_findings:
        findings.extend(placement.topology_findings)
    return sorted(findings, key=lambda finding: LEVELS.index(finding.level))
