"""The simulated vLLM server's command line and request bodies, for the simulator's tests."""

from __future__ import annotations

ARGV = [
    "--model", "llama-2-7b-chat-hf", "--served-model-name", "llama-2-7b", "--hardware", "v100-sxm2-32gb",
    "--tensor-parallel-size", "8", "--dtype", "float16", "--max-model-len", "4096",
    "--gpu-memory-utilization", "0.93", "--enable-prefix-caching", "--enable-chunked-prefill",
    "--enforce-eager",
]  # fmt: skip


def completion(**extra):
    return {"model": "llama-2-7b", "prompt": "The node agent starts the engine. " * 20, **extra}


# The profile of every recorded GPU run in tests/sim/data (scripts/gpu_run.py's `profile_for`).
RECORDED_PROFILE = dict(
    dtype="float16",
    tensor_parallel_size=1,
    gpu_memory_utilization=0.9,
    max_num_seqs=256,
    block_size=16,
    max_model_len=4096,
    max_num_batched_tokens=8192,
    enable_prefix_caching=False,
    enable_chunked_prefill=True,
)


def recorded_config(model: str, mode: str, gpu: str, host=None):
    """The simulator's engine for a recorded run's model, mode ("eager" or "graphs") and GPU."""
    from inference.hardware import get_gpu
    from inference.hf_config import resolve_model_config
    from inference.profile import ProfileSettings
    from inference.sim.costs import DEFAULT_HOST_COSTS
    from inference.sim.engine import EngineConfig

    profile = ProfileSettings(enforce_eager=mode == "eager", **RECORDED_PROFILE)
    return EngineConfig(
        model=resolve_model_config(model), profile=profile, gpu=get_gpu(gpu), host=host or DEFAULT_HOST_COSTS
    )
