"""Steady streaming load through the gateway on one served name, and simulated versions behind it:
what the rollout benchmark (perf/rollout_bench.py) and the end-to-end rollout tests
(tests/rollouts/test_end_to_end.py) share.

Each client thread sends one streamed chat completion after another and records, per request, when
it began, which version answered (the `model` of the chunks), its time to first token, and whether
it finished whole: a 200, chunks up to `finish_reason` and `[DONE]`. Anything else is a failure
(a status other than 200, an error chunk, a stream cut before `[DONE]`, a transport error).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from devtools import free_port, wait_for_http
from perf._common import spawn

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Outcome:
    started: float  # time.time() when the request was sent
    ended: float
    ok: bool
    version: str  # the version that served it ("" when none answered)
    ttft_ms: float | None
    error: str = ""


@dataclass
class SteadyLoad:
    """`clients` threads, each sending the next request as soon as the last one finished."""

    url: str  # the gateway's root
    token: str
    model: str  # the served name
    clients: int = 4
    max_tokens: int = 8
    timeout_s: float = 60
    outcomes: list[Outcome] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> SteadyLoad:
        for _ in range(self.clients):
            thread = threading.Thread(target=self._client, daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self) -> list[Outcome]:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=self.timeout_s + 5)
        return self.snapshot()

    def snapshot(self) -> list[Outcome]:
        with self._lock:
            return list(self.outcomes)

    def count(self, version: str | None = None, *, since: float = 0.0) -> int:
        return sum(
            1 for o in self.snapshot() if o.started >= since and (version is None or o.version == version)
        )

    def _client(self) -> None:
        headers = {"Authorization": f"Bearer {self.token}"}
        with httpx.Client(timeout=self.timeout_s, headers=headers) as client:
            while not self._stop.is_set():
                outcome = one_request(client, f"{self.url}/v1/chat/completions", self.model, self.max_tokens)
                with self._lock:
                    self.outcomes.append(outcome)


def one_request(client: httpx.Client, url: str, model: str, max_tokens: int) -> Outcome:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Say something short."}],
        "max_tokens": max_tokens,
        "stream": True,
    }
    started = time.time()
    began = time.monotonic()
    version, ttft_ms, finished, done = "", None, False, False
    try:
        with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                response.read()
                text = response.text[:200]
                return Outcome(started, time.time(), False, "", None, f"{response.status_code}: {text}")
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    return Outcome(
                        started, time.time(), False, version, ttft_ms, f"error chunk: {data[:200]}"
                    )
                version = chunk.get("model", version)
                for choice in chunk.get("choices", []):
                    if ttft_ms is None and (choice.get("delta") or {}).get("content"):
                        ttft_ms = (time.monotonic() - began) * 1000
                    finished = finished or bool(choice.get("finish_reason"))
    except httpx.HTTPError as error:
        return Outcome(started, time.time(), False, version, ttft_ms, f"{type(error).__name__}: {error}")
    ok = finished and done
    return Outcome(started, time.time(), ok, version, ttft_ms, "" if ok else "stream cut before [DONE]")


def spawn_sim(served_name: str, log_path: Path, *, speedup: float = 1.0) -> tuple[str, subprocess.Popen]:
    """The simulator (`python -m inference.sim`) serving a 7B on a simulated V100 under
    `served_name`; `speedup` below 1 runs its clock slower (a version that breaks the SLA)."""
    port = free_port()
    argv = [
        sys.executable, "-m", "inference.sim", "--model", "llama-2-7b-chat-hf", "--dtype", "float16",
        "--served-model-name", served_name, "--port", str(port), "--hardware", "v100-sxm2-32gb",
        "--speedup", str(speedup),
    ]  # fmt: skip
    with open(log_path, "wb") as log:
        process = spawn(
            argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(ROOT)}
        )
    url = f"http://127.0.0.1:{port}"
    wait_for_http(f"{url}/health", watch=process, timeout_s=60)
    return url, process


def p95(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]
