"""Time the parts of vLLM's engine step in every process of a server (issue 40).

Put this folder first on `PYTHONPATH` and set `STEP_TIMER_DIR` when starting
`vllm.entrypoints.openai.api_server`: Python imports `sitecustomize` at start in the API
server and in the engine-core process it spawns, and each process then appends one line per
call of the methods below to `$STEP_TIMER_DIR/<pid>.tsv`:

    part  start (time.time(), s)  duration (s)  requests  tokens

The parts: the scheduler's `schedule` and `update_from_output`, the model runner's
`execute_model` (input preparation plus launching the forward) and `sample_tokens`, the
model's own `forward` (eager: launching every layer's kernels; it returns before the GPU is
done), the engine core's `step` / `step_with_batch_queue`, and the API server's
`process_outputs` (detokenizing and handing tokens to the streams). A method missing in the
installed vLLM is skipped with a line on stderr, never an error. Without `STEP_TIMER_DIR`
nothing is patched. `scripts/gpu_host_probe.py` reads the files.
"""

from __future__ import annotations

import atexit
import functools
import importlib.abc
import importlib.util
import os
import sys
import threading
import time
from typing import Any

OUT = os.environ.get("STEP_TIMER_DIR")

# module -> classes (by exact name, or "*ForCausalLM" for any model class) -> methods
TARGETS: dict[str, dict[str, tuple[str, ...]]] = {
    "vllm.v1.core.sched.scheduler": {"Scheduler": ("schedule", "update_from_output")},
    "vllm.v1.worker.gpu.model_runner": {"GPUModelRunner": ("execute_model", "sample_tokens")},
    "vllm.v1.worker.gpu_model_runner": {"GPUModelRunner": ("execute_model", "sample_tokens")},
    "vllm.v1.engine.core": {"EngineCore": ("step", "step_with_batch_queue")},
    "vllm.v1.engine.output_processor": {"OutputProcessor": ("process_outputs",)},
    "vllm.model_executor.models.llama": {"*ForCausalLM": ("forward",)},
    "vllm.model_executor.models.mistral": {"*ForCausalLM": ("forward",)},
    "vllm.model_executor.models.qwen2": {"*ForCausalLM": ("forward",)},
}


class _Sink:
    """Buffered lines, written at most once a second (a killed server loses under a second)."""

    def __init__(self, directory: str) -> None:
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, f"{os.getpid()}.tsv")
        self.lines: list[str] = []
        self.flushed = time.monotonic()
        self.lock = threading.Lock()

    def add(self, line: str) -> None:
        with self.lock:
            self.lines.append(line)
            if time.monotonic() - self.flushed < 1.0:
                return
        self.flush()

    def flush(self) -> None:
        with self.lock:
            lines, self.lines = self.lines, []
            self.flushed = time.monotonic()
        if lines:
            with open(self.path, "a", encoding="ascii") as handle:
                handle.write("".join(lines))


def _sizes(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, int]:
    """Requests and tokens of a call that takes a scheduler output (else 0, 0; outputs: a count)."""
    for value in (*args, *kwargs.values()):
        scheduled = getattr(value, "num_scheduled_tokens", None)
        if isinstance(scheduled, dict):
            return len(scheduled), int(getattr(value, "total_num_scheduled_tokens", 0))
        if isinstance(value, list):
            return len(value), 0
        outputs = getattr(value, "outputs", None)
        if isinstance(outputs, list):
            return len(outputs), 0
    return 0, 0


def _timed(sink: _Sink, part: str, method: Any) -> Any:
    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        began = time.time()
        result = None
        try:
            result = method(*args, **kwargs)
            return result
        finally:
            ended = time.time()
            requests, tokens = _sizes(args[1:], kwargs)
            if not requests:  # schedule(): the sizes are those of what it returns
                requests, tokens = _sizes((result,), {})
            sink.add(f"{part}\t{began:.6f}\t{ended - began:.6f}\t{requests}\t{tokens}\n")

    wrapper.__step_timer__ = True  # type: ignore[attr-defined]
    return wrapper


def _patch(sink: _Sink, module: Any, classes: dict[str, tuple[str, ...]]) -> None:
    for class_name, methods in classes.items():
        if class_name.startswith("*"):
            found = [
                value
                for name, value in vars(module).items()
                if isinstance(value, type)
                and name.endswith(class_name[1:])
                and value.__module__ == module.__name__
            ]
        else:
            found = [getattr(module, class_name)] if hasattr(module, class_name) else []
        for cls in found:
            for name in methods:
                method = cls.__dict__.get(name)
                if method is None or getattr(method, "__step_timer__", False):
                    continue
                part = "forward" if name == "forward" else name
                setattr(cls, name, _timed(sink, part, method))
        if not found:
            print(f"step_timer: {module.__name__} has no {class_name}", file=sys.stderr)


class _Finder(importlib.abc.MetaPathFinder):
    """Patch each target module right after it is first imported."""

    def __init__(self, sink: _Sink) -> None:
        self.sink = sink

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in TARGETS:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        loader = spec.loader
        original = loader.exec_module
        sink = self.sink

        def exec_module(module: Any) -> None:
            original(module)
            try:
                _patch(sink, module, TARGETS[name])
            except Exception as error:  # a timer must never stop the server
                print(f"step_timer: {name}: {error!r}", file=sys.stderr)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if OUT:
    _SINK = _Sink(OUT)
    sys.meta_path.insert(0, _Finder(_SINK))
    atexit.register(_SINK.flush)
