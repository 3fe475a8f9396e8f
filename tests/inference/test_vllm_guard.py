"""inference.vllm_guard: the key on every vLLM path but liveness and counters."""

from __future__ import annotations

import importlib

import pytest

from inference.vllm_args import VLLM_GUARD_MIDDLEWARE, vllm_command


@pytest.fixture
def guard(monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "k-guard")
    import inference.vllm_guard

    yield importlib.reload(inference.vllm_guard)
    monkeypatch.delenv("VLLM_API_KEY")
    importlib.reload(inference.vllm_guard)


@pytest.mark.parametrize("path", ["/invocations", "/tokenize", "/detokenize", "/pooling", "/v1/models", "/"])
def test_it_refuses_every_other_path_without_the_key(guard, path):
    assert not guard.allowed(path, "POST", None)
    assert not guard.allowed(path, "POST", "Bearer wrong")
    assert not guard.allowed(path, "POST", "Basic k-guard")
    assert guard.allowed(path, "POST", "Bearer k-guard")
    assert guard.allowed(path, "POST", "bearer k-guard")


@pytest.mark.parametrize("path", ["/health", "/ping", "/metrics", "/version", "/health/"])
def test_it_leaves_liveness_and_counters_open(guard, path):
    assert guard.allowed(path, "GET", None)


def test_it_lets_everything_through_when_the_server_has_no_key(monkeypatch):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    import inference.vllm_guard

    guard = importlib.reload(inference.vllm_guard)
    assert guard.allowed("/invocations", "POST", None)


def test_the_agent_launches_vllm_with_the_guard():
    argv = vllm_command("/opt/vllm/bin/python", ["--port", "8000"], guard=True)
    assert argv[-2:] == ["--middleware", VLLM_GUARD_MIDDLEWARE]
    module, name = VLLM_GUARD_MIDDLEWARE.rsplit(".", 1)
    assert callable(getattr(importlib.import_module(module), name))
