"""`python -m inference.sim` starts like vLLM: binds 127.0.0.1, serves, and exits 1 on a refusal."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from devtools import free_port, stop

REPO = Path(__file__).resolve().parents[2]


def launch(*flags: str) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "inference.sim",
            "--model",
            "llama-2-7b-chat-hf",
            "--dtype",
            "float16",
            *flags,
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )


def test_it_serves_on_localhost_until_terminated():
    port = free_port()
    process = launch("--served-model-name", "llama-2-7b", "--port", str(port), "--hardware", "v100-sxm2-32gb")
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert process.poll() is None, process.stderr.read()
            assert time.monotonic() < deadline, "the simulator did not become healthy"
            time.sleep(0.1)
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=5).json()
        assert models["data"][0]["id"] == "llama-2-7b"
    finally:
        stop(process, grace_s=10)


def test_it_exits_with_vllms_message_when_vllm_would_not_start():
    process = launch("--hardware", "v100-pcie-16gb", "--max-model-len", "4096")
    _, err = process.communicate(timeout=30)
    assert process.returncode == 1
    assert "KV cache" in err or "CUDA out of memory" in err
