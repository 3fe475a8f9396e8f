"""Fixtures for lifecycle tests (a pytest plugin, tests/conftest.py): a node whose "vLLM" is
the fast stand-in engine.

`fake_node` points its vLLM Python at this interpreter and puts
tests/deployments/fake_engine first on PYTHONPATH, so the portal's real launch
path (`python -m vllm.entrypoints.openai.api_server …`, own process group, log
file, health wait, warm-up, smoke test) runs in a fraction of a second.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from inference import supervisor
from tests.helpers import ROOT
from tests.helpers.builders import cpu_node_with

FAKE_ENGINE = ROOT / "tests" / "deployments" / "fake_engine"


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
