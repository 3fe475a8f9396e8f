"""What a node acceptance may be asked (shape, levels, requests per level), its defaults, and the
names it gives what it makes (the reference model and deployment)."""

from __future__ import annotations

import re
from typing import Any

from inference.tiny_model import TINY_SHAPE
from portal.core.errors import ApplicationError
from portal.deployments.models import DeploymentProfile
from portal.inventory.models import Node, NodeAcceptance

DEFAULT_SHAPE = "llama-2-7b-chat-hf"
DEFAULT_MIX = "short-qa"
DEFAULT_CONCURRENCY = (1, 16, 64)
MIN_LEVELS, MAX_LEVELS = 2, 4
MAX_CONCURRENCY = 1024
MAX_REQUESTS_PER_LEVEL = 100_000
QUEUED = "queued"  # the step of a requested acceptance no runner has claimed yet
SEED = 0

# What a deployment profile brings to the reference server's launch (`--profile`). Not its dtype
# (the acceptance's: fp16 on a GPU, fp32 on a CPU), tensor parallelism (one GPU), quantization
# (random unquantized weights), extra_args or engine (the node's): the reference model stays the
# acceptance's own shape; these are the flags that change how vLLM schedules and caches it.
LAUNCH_FLAGS = (
    "enable_chunked_prefill",
    "enable_prefix_caching",
    "max_num_batched_tokens",
    "max_model_len",  # capped by the reference model's positions when it starts
    "block_size",
    "enforce_eager",
    "max_num_seqs",
    "gpu_memory_utilization",
    "kv_cache_dtype",
    "swap_space_gb",
)


def reference_profile_values(
    *, cpu: bool, positions: int, most_users: int, enforce_eager: bool, flags: dict | None = None
) -> dict:
    """The reference server's vLLM settings: vLLM's defaults on a GPU; docs/operators.md's `cpu-tiny-llama`
    settings on a CPU; `flags` (a deployment profile's LAUNCH_FLAGS, or only the ones the form
    sets, such as max_model_len) over those, max_model_len capped by the model's positions. A CPU
    is always eager. The request plans with these before anything is written; the run launches them."""
    values: dict[str, Any]
    if cpu:
        values = {
            "dtype": "float32",
            "max_model_len": min(512, positions),
            "gpu_memory_utilization": 0.2,  # on CPU: the share of host memory for the KV cache
            "max_num_seqs": max(8, most_users),
            "block_size": 128,  # vLLM's CPU attention wants a multiple of 32
            "enable_chunked_prefill": True,
            "enforce_eager": True,
        }
    else:
        values = {
            "dtype": "float16",
            "max_model_len": min(4096, positions),
            "gpu_memory_utilization": 0.9,
            "max_num_seqs": max(256, most_users),
            "block_size": 16,
            "enable_chunked_prefill": True,
            "enforce_eager": enforce_eager,
        }
    if flags:
        values |= {flag: flags[flag] for flag in LAUNCH_FLAGS if flag in flags}
        values["max_model_len"] = min(values["max_model_len"] or positions, positions)
        values["enforce_eager"] = values["enforce_eager"] or cpu
    return values


def requests_per_level_default(concurrency: int) -> int:
    """Four requests per user, at least eight: 1 user × 8 requests of a 7B in eager mode is
    about a minute on an H200, and 64 users × 4 fill the batch long enough to be steady."""
    return max(8, 4 * concurrency)


def parse_levels(value: str | list[int] | tuple[int, ...]) -> list[int]:
    """2–4 distinct concurrency levels, each 1…1024, ascending; else ApplicationError on `concurrency`."""
    if isinstance(value, str):
        parts = [p for p in re.split(r"[,\s]+", value.strip()) if p]  # commas, spaces or both
        if not all(p.isdigit() for p in parts):
            raise ApplicationError(
                f"write the levels as whole numbers separated by commas, got {value!r}", field="concurrency"
            )
        levels = [int(p) for p in parts]
    else:
        levels = list(value)
    if not MIN_LEVELS <= len(set(levels)) <= MAX_LEVELS:
        raise ApplicationError(
            f"give {MIN_LEVELS} to {MAX_LEVELS} different levels (two to calibrate from), got {levels}",
            field="concurrency",
        )
    if any(isinstance(c, bool) or not isinstance(c, int) or not 1 <= c <= MAX_CONCURRENCY for c in levels):
        raise ApplicationError(f"each level must be between 1 and {MAX_CONCURRENCY}", field="concurrency")
    return sorted(set(levels))


def default_shape_for(node: Node) -> str:
    """The reference shape a node is accepted with unless one is chosen: tiny on a CPU-only node,
    where a 7B shape would be 27 GB of float32 weights in its RAM; a 7B on a GPU node."""
    return TINY_SHAPE if node.is_cpu_only else DEFAULT_SHAPE


def model_name_for(acceptance: NodeAcceptance) -> str:
    """The reference model's name: its shape, layer count and dtype (same name, same bytes)."""
    layers = f"-l{acceptance.layers}" if acceptance.layers else ""
    return f"accept-{acceptance.shape}{layers}-{'fp16' if acceptance.dtype == 'float16' else 'fp32'}"


def reference_deployment_name(acceptance: NodeAcceptance) -> str:
    """The deployment that serves the reference model during this acceptance; a runner that took
    the acceptance over (its second claim on) has its own, beside the one a stalled runner left."""
    taken_over = f"-{acceptance.lease_token}" if acceptance.lease_token > 1 else ""
    return acceptance.deployment_name or f"accept-{acceptance.node.name}-{acceptance.pk}{taken_over}"


def profile_by_name(name: str) -> DeploymentProfile:
    """The profile an acceptance runs with; ApplicationError on `profile` when there is none."""
    profile = DeploymentProfile.objects.filter(name=name).first()
    if profile is None:
        known = ", ".join(DeploymentProfile.objects.order_by("name").values_list("name", flat=True)[:10])
        raise ApplicationError(
            f"no deployment profile named {name!r} (profiles: {known or 'none yet'})", field="profile"
        )
    return profile


def profile_launch_flags(profile: DeploymentProfile) -> dict:
    """The profile's vLLM launch flags the reference server takes (LAUNCH_FLAGS)."""
    return {flag: getattr(profile, flag) for flag in LAUNCH_FLAGS}


def probed_features(flags: dict | None) -> list[str]:
    """The features vLLM marks unsupported on Volta that these flags turn on (feature_probe tries them)."""
    return [flag for flag in ("enable_chunked_prefill", "enable_prefix_caching") if (flags or {}).get(flag)]
