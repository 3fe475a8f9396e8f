"""A vLLM-compatible simulated engine: same launch flags, same HTTP API, V100-like timing.

- `costs`: one step's time from the roofline of the simulated GPUs plus overheads.
- `kv_cache`, `scheduler`: vLLM's paged KV cache and continuous-batching scheduler.
- `engine`: a model × profile × GPUs, with vLLM's startup refusals.
- `server`, `cli` (`python -m inference.sim`): the OpenAI-compatible server.
- `virtual`: the same engine on a virtual clock, for concurrency sweeps in seconds.
"""
