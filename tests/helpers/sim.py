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
