"""Builders for lifecycle tests: a node whose "vLLM" is the fast stand-in engine.

`fake_node` points its vLLM Python at this interpreter and puts
tests/deployments/fake_engine first on PYTHONPATH, so the portal's real launch
path (`python -m vllm.entrypoints.openai.api_server …`, own process group, log
file, health wait, warm-up, smoke test) runs in a fraction of a second.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from django.utils import timezone

from inference import supervisor

FAKE_ENGINE = Path(__file__).resolve().parent / "fake_engine"


@pytest.fixture
def run_dir(tmp_path, settings):
    settings.PORTAL_RUN_DIR = str(tmp_path / "run")
    settings.DEPLOYMENT_STOP_GRACE_S = 5
    settings.DEPLOYMENT_DRAIN_TIMEOUT_S = 3
    settings.DEPLOYMENT_READY_TIMEOUT_S = 20
    return Path(settings.PORTAL_RUN_DIR)


@pytest.fixture
def fake_engine(monkeypatch, run_dir):
    monkeypatch.setenv("PYTHONPATH", str(FAKE_ENGINE))
    return FAKE_ENGINE


def cpu_node_with(name: str, python: str):
    """A CPU node whose vLLM environment was already probed (the probe has its own tests)."""
    from portal.inventory.models import Node

    return Node.objects.create(
        name=name,
        hostname="127.0.0.1",
        vllm_python=python,
        vllm_version="0.32.0",
        torch_version="2.13.0+cpu",
        software_python=python,
        software_probed_at=timezone.now(),
    )


@pytest.fixture
def fake_node(db, fake_engine):
    return cpu_node_with("fake-node", sys.executable)


@pytest.fixture
def tiny_version(db, tiny_model_dir):
    """The tiny Llama registered with its release hashes."""
    import json

    from portal.registry.services import model_version_create, model_version_hash_files

    config = json.loads((tiny_model_dir / "config.json").read_text())
    version = model_version_create(name="tiny-llama", config=config, path=str(tiny_model_dir))
    return model_version_hash_files(model_version=version)


@pytest.fixture
def tiny_profile(db):
    from portal.deployments.models import DeploymentProfile

    return DeploymentProfile.objects.create(
        name="cpu-tiny",
        dtype="float32",
        max_model_len=512,
        gpu_memory_utilization=0.2,
        max_num_seqs=8,
        block_size=128,  # vLLM's CPU attention wants a multiple of 32 (and defaults to 128)
        enable_chunked_prefill=True,  # vLLM V1 warns that turning it off may crash the engine
        enforce_eager=True,
    )


@pytest.fixture
def reap_servers(db):
    """Stop every process group a test's deployments recorded, whatever the test did."""
    launched: list[int] = []
    yield launched
    from portal.deployments.models import Deployment

    for pgid in [*launched, *Deployment.objects.exclude(pgid=None).values_list("pgid", flat=True)]:
        supervisor.stop_group(pgid, grace_s=2, kill_wait_s=5)


def make_deployment(team, version, profile, node, *, name="tiny", desired_state="running", gpus=()):
    from portal.deployments.services import deployment_create

    return deployment_create(
        name=name,
        team=team,
        model_version=version,
        profile=profile,
        node=node,
        gpu_indices=list(gpus),
        desired_state=desired_state,
    )
