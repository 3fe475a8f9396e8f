"""A vLLM log → the known cause of a failed start, and what to do about it.

A server that exits during start-up for one of these reasons will exit the same
way next time, so the portal reports it (`failed`, with the cause and the fix)
instead of restarting it in a loop. The patterns are vLLM's and PyTorch's own
wording (vLLM 0.10–0.32: `vllm/platforms/cuda.py`, `vllm/config/vllm.py`,
`vllm/config/model.py`, `vllm/v1/core/kv_cache_utils.py`,
`vllm/v1/worker/utils.py`, the API server's socket bind), matched case-insensitively.

The first matching cause in `CAUSES` wins: the list is ordered from the most
specific message to the most generic, because one failure often prints several
(a KV-cache error is followed by "Engine core initialization failed").
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class StartupCause:
    code: str
    title: str
    fix: str
    patterns: tuple[str, ...]

    def matches(self, line: str) -> re.Match[str] | None:
        for pattern in self.patterns:
            found = re.search(pattern, line, re.IGNORECASE)
            if found:
                return found
        return None


@dataclass(frozen=True)
class Diagnosis:
    """What went wrong: the cause, the fix, and the log line that shows it."""

    code: str
    title: str
    fix: str
    evidence: str

    def reason(self) -> str:
        """One text for `state_reason`: cause, fix, then the line it was read from."""
        return f"{self.title}. Fix: {self.fix} (log: {self.evidence})"


CAUSES: tuple[StartupCause, ...] = (
    StartupCause(
        code="bf16_unsupported",
        title="bfloat16 is not supported on this GPU (compute capability below 8.0)",
        fix="set the profile's dtype to float16 (V100 has no bf16); for a bf16 checkpoint, "
        "convert it to fp16 first",
        patterns=(r"Bfloat16 is only supported on GPUs with compute capability of at least 8\.0",),
    ),
    StartupCause(
        code="quantization_unsupported",
        title="the quantization method needs a newer GPU than this one",
        fix="use a quantization this GPU supports (on V100, compute capability 7.0: GPTQ, not AWQ) "
        "or an fp16 build of the model",
        patterns=(
            r"The quantization method \S+ is not supported for the current GPU\. "
            r"Minimum capability: \d+\. Current capability: \d+",
            r"is not supported for the current GPU\. Minimum capability",
        ),
    ),
    StartupCause(
        code="kv_cache_too_small",
        title="the KV cache cannot hold one sequence of the maximum model length",
        fix="lower max_model_len (vLLM's estimate of what fits is in the log line) or raise "
        "gpu_memory_utilization, or use more GPUs (tensor parallel)",
        patterns=(
            r"KV cache is needed, which is larger than the available KV cache memory",
            r"No available memory for the cache blocks",
            r"Insufficient memory for the cache blocks",
        ),
    ),
    StartupCause(
        code="max_model_len_exceeds_positions",
        title="max_model_len is longer than the model's maximum positions",
        fix="lower max_model_len to the model's max_position_embeddings (or leave it blank)",
        patterns=(
            r"User-specified max_model_len \(\d+\) is greater than the derived max_model_len",
            r"User-specified max_model_len \(\d+\) is greater than",
        ),
    ),
    StartupCause(
        code="cuda_out_of_memory",
        title="CUDA out of memory while loading the model or reserving memory",
        fix="lower gpu_memory_utilization (0.92–0.93 ran clean on V100), free the GPUs from other "
        "processes, or use more GPUs (tensor parallel)",
        patterns=(
            r"CUDA out of memory",
            r"torch\.OutOfMemoryError",
            r"torch\.cuda\.OutOfMemoryError",
            r"on startup is less than desired GPU memory utilization",
            r"on startup is less than the engine's budget",
            r"cudaErrorMemoryAllocation",
        ),
    ),
    StartupCause(
        code="cuda_graph_capture_failed",
        title="CUDA graph capture failed",
        fix="turn on enforce_eager in the profile (the safe default on Volta)",
        patterns=(
            r"operation not permitted when stream is capturing",
            r"cudaErrorStreamCapture\w*",
            r"CUDA graph capture (failed|error)",
            r"capture_model.*(Error|failed)",
            r"Capturing CUDA graphs.*(Error|failed)",
        ),
    ),
    StartupCause(
        code="address_in_use",
        title="the server's port is already in use",
        fix="start again: the portal picks a free port; stop whatever else listens on it",
        patterns=(
            r"\[Errno 98\] Address already in use",
            r"error while attempting to bind on address .*address already in use",
            r"Address already in use",
        ),
    ),
    StartupCause(
        code="attention_unsupported",
        title="no attention backend supports this model and device configuration",
        fix="use a block size and head size this build's attention kernels support (the CPU "
        "kernels need block_size a multiple of 32 and head_dim 32/64/80/96/112/128/256; "
        "FlashAttention needs compute capability 8.0; on V100 use float16)",
        patterns=(
            r"No common block size for \d+",
            r"No valid attention backend found",
            r"Head size \d+ is not supported",
            r"Cannot use FlashAttention-2 backend",
            r"Unsupported head size",
            r"attention backend .* is not supported",
        ),
    ),
    StartupCause(
        code="no_kernel_image",
        title="the node's PyTorch build has no kernels for this GPU",
        fix="install a build that ships this GPU's sm_XY kernels (for V100, sm_70: a CUDA 12.6 "
        "build of PyTorch and a vLLM built against it)",
        patterns=(r"no kernel image is available for execution on the device",),
    ),
    StartupCause(
        code="unsupported_flag",
        title="this vLLM version does not accept one of the profile's flags",
        fix="remove or rename the flag in the profile (the log names it); e.g. vLLM ≥ 0.11 has no "
        "--swap-space",
        patterns=(r"error: unrecognized arguments: .*", r"error: argument --[\w-]+: .*"),
    ),
    StartupCause(
        code="model_files_missing",
        title="the model directory lacks files vLLM needs",
        fix="restore the model files on the node (compare with the registry's file list)",
        patterns=(
            r"No such file or directory: .*(config\.json|\.safetensors|tokenizer)",
            r"Cannot find any of \[.*\] in the model",
            r"does not appear to have a file named",
            r"Invalid repository ID or local directory specified",
            r"Can't load (the )?(tokenizer|config)",
        ),
    ),
)

# Lines that say where the real error is, but not what it is.
_TRACEBACK_NOISE = re.compile(r"^(Traceback|\s+File |\s+\^|During handling)")


def classify_startup_log(text: str) -> Diagnosis | None:
    """The first known cause found in a log (by cause priority), or None when none matches."""
    lines = text.splitlines()
    for cause in CAUSES:
        for line in lines:
            if cause.matches(line):
                return Diagnosis(
                    code=cause.code, title=cause.title, fix=cause.fix, evidence=_trim(line.strip())
                )
    return None


def last_error_line(text: str) -> str:
    """The last line that looks like an error, for failures no cause matches."""
    for line in reversed(text.splitlines()):
        stripped = line.strip()
        if not stripped or _TRACEBACK_NOISE.match(line):
            continue
        if re.search(r"(Error|Exception|error:|failed|Killed)", stripped):
            return _trim(stripped)
    return ""


def _trim(line: str, limit: int = 400) -> str:
    return line if len(line) <= limit else line[: limit - 1] + "…"
