"""A deployment profile → the argv of `python -m vllm.entrypoints.openai.api_server`.

One function builds the flags for both engines: the real vLLM and the simulator
(`python -m inference.sim`), which accepts the same flags plus `--hardware`.
The portal owns where a server listens and what it serves (`--model`,
`--served-model-name`, `--host`, `--port`), so a profile's free-form extras may
not set those; everything else in the extras is passed through unchanged, after
the profile's own flags (argparse keeps the last value, so an extra wins).

Flags are written only where they say something: a value equal to vLLM's own
default is still written when it matters on V100 (dtype, eager mode), because
vLLM's defaults changed across versions and the command line on the deployment
page should read as the whole launch recipe.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from dataclasses import dataclass

from inference.errors import InputError
from inference.planner import ProfileSettings

VLLM_MODULE = "vllm.entrypoints.openai.api_server"
SIM_MODULE = "inference.sim"

# Flags the portal sets itself; an extra arg naming one would silently move the
# server away from the port and model the portal routes to.
RESERVED_FLAGS = frozenset({"--model", "--served-model-name", "--host", "--port", "--hardware"})

# vLLM's own default for --swap-space (GiB) in the versions that had the flag.
# Newer vLLM (V1 engine only, e.g. 0.32) removed it: the flag is written only
# when a profile asks for something else, and the startup classifier explains
# the "unrecognized arguments" error on a vLLM that no longer knows it.
VLLM_DEFAULT_SWAP_SPACE_GB = 4.0


@dataclass(frozen=True)
class ServerArgs:
    """Where the server reads its model and listens."""

    model_path: str
    served_model_name: str
    host: str
    port: int


def vllm_args(profile: ProfileSettings, server: ServerArgs, *, extra_args: Sequence[str] = ()) -> list[str]:
    """The flags after `-m vllm.entrypoints.openai.api_server` (or `-m inference.sim`)."""
    check_extra_args(extra_args)
    if not 0 < server.port < 65536:
        raise InputError("port", f"must be 1..65535, got {server.port}")
    args = [
        "--model",
        server.model_path,
        "--served-model-name",
        server.served_model_name,
        "--host",
        server.host,
        "--port",
        str(server.port),
        "--dtype",
        profile.dtype,
        "--tensor-parallel-size",
        str(profile.tensor_parallel_size),
        "--gpu-memory-utilization",
        _number(profile.gpu_memory_utilization),
        "--max-num-seqs",
        str(profile.max_num_seqs),
        "--block-size",
        str(profile.block_size),
    ]
    if profile.max_model_len is not None:
        args += ["--max-model-len", str(profile.max_model_len)]
    if profile.max_num_batched_tokens is not None:
        args += ["--max-num-batched-tokens", str(profile.max_num_batched_tokens)]
    # vLLM's V1 engine turns prefix caching and chunked prefill on by default;
    # the V0 engine had them off. Saying both explicitly makes the profile mean
    # the same thing on every version that has the --no- forms (0.10 and later).
    args.append("--enable-prefix-caching" if profile.enable_prefix_caching else "--no-enable-prefix-caching")
    args.append(
        "--enable-chunked-prefill" if profile.enable_chunked_prefill else "--no-enable-chunked-prefill"
    )
    if profile.enforce_eager:
        args.append("--enforce-eager")
    if profile.quantization:
        args += ["--quantization", profile.quantization]
    if profile.kv_cache_dtype != "auto":
        args += ["--kv-cache-dtype", profile.kv_cache_dtype]
    if profile.swap_space_gb != VLLM_DEFAULT_SWAP_SPACE_GB:
        args += ["--swap-space", _number(profile.swap_space_gb)]
    return args + list(extra_args)


def check_extra_args(extra_args: Sequence[str]) -> None:
    """Refuse extras that are not strings or that set a flag the portal owns."""
    for arg in extra_args:
        if not isinstance(arg, str):
            raise InputError("extra_args", f"must be strings, got {arg!r}")
        flag = arg.split("=", 1)[0]
        if flag in RESERVED_FLAGS:
            raise InputError("extra_args", f"{flag} is set by the portal; remove it from the profile")


# Guards every path but /health, /metrics, /ping and /version with VLLM_API_KEY (vLLM itself
# guards only /v1, /v2, /inference and /cohere); needs the portal's code on PYTHONPATH.
VLLM_GUARD_MIDDLEWARE = "inference.vllm_guard.guard"


def vllm_command(python: str, args: Sequence[str], *, guard: bool = False) -> list[str]:
    """The real engine, from the node's vLLM environment (`guard`: with inference.vllm_guard)."""
    return [python, "-m", VLLM_MODULE, *args, *(["--middleware", VLLM_GUARD_MIDDLEWARE] if guard else [])]


def sim_command(python: str, args: Sequence[str], *, hardware: str | None) -> list[str]:
    """The simulator with the same flags, plus the catalog key of the GPUs it pretends to be."""
    command = [python, "-m", SIM_MODULE, *args]
    if hardware:
        command += ["--hardware", hardware]
    return command


def command_line(argv: Sequence[str]) -> str:
    """The argv as a shell would need it typed (for the deployment page)."""
    return shlex.join(argv)


def _number(value: float) -> str:
    """0.93 → "0.93", 4.0 → "4" (what an operator would type)."""
    return f"{value:g}"
