"""A real Celery worker on `node.<name>` runs conversion jobs; `kill -9` of it mid-way leaves nothing.

The agent is a separate process (solo pool, like a node agent) against the test
database and this run's Redis, as in tests/inventory/test_agent_queue.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import redis
from django.conf import settings
from django.db import connection

from devtools import wait_until
from inference.convert import bf16_bits_to_fp16
from inference.hashing import hash_model_dir
from portal.core.redis.client import redis_keys
from portal.inventory.services import node_create
from portal.registry.models import ConversionJob, ConversionState, ModelVersion
from portal.registry.services import conversion_job_start, model_version_create
from tests.helpers.safetensors import fp16_bits_of, write_safetensors
from tests.helpers.samples import bundled_config

ROOT = Path(__file__).resolve().parents[2]
NODE = "ci-convert"
LEASE_S = 2

pytestmark = [pytest.mark.django_db(transaction=True)]


def start_agent() -> subprocess.Popen:
    db = connection.settings_dict
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "DATABASE_URL": f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}",
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        # A short lease so the test sees a killed job as interrupted within seconds.
        "PORTAL_CONVERSION_LEASE_S": str(LEASE_S),
    }
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "portal",
            "worker",
            "-Q",
            f"node.{NODE}",
            "-n",
            f"{NODE}@%h",
            "--concurrency",
            "1",
            "--pool",
            "solo",
            "--loglevel",
            "WARNING",
        ],
        cwd=ROOT,
        env=env,
        start_new_session=True,
    )


def stop(process: subprocess.Popen, sig=signal.SIGTERM) -> None:
    if process.poll() is None:
        os.killpg(process.pid, sig)
    process.wait(timeout=30)


@pytest.fixture
def agents():
    started: list[subprocess.Popen] = []
    yield lambda: started.append(start_agent()) or started[-1]
    for process in started:
        stop(process)
    # A task whose worker was killed stays unacked in the broker and would be
    # redelivered after the visibility timeout: drop it with this test's Redis db.
    client = redis.Redis.from_url(settings.CELERY_BROKER_URL)
    client.delete(*[redis_keys().celery_key(name) for name in ("unacked", "unacked_index", f"node.{NODE}")])


def bf16_model(root: Path, *, tensors: int, elements: int) -> tuple[ModelVersion, list[np.ndarray]]:
    """A registered bf16 model: `tensors` tensors of weight-like random values."""
    rng = np.random.default_rng(7)
    block = (rng.standard_normal(1 << 16, dtype=np.float32) * 0.02).view(np.uint32) >> 16
    arrays = [np.resize(np.roll(block, i).astype("<u2"), elements) for i in range(tensors)]
    root.mkdir()
    tensors = {f"layer.{i}": ("BF16", (elements,), a.tobytes()) for i, a in enumerate(arrays)}
    write_safetensors(root / "model.safetensors", tensors)
    config = bundled_config("qwen2.5-7b-instruct")
    (root / "config.json").write_text(json.dumps(config))
    (root / "tokenizer.json").write_text('{"model": {}}')
    version = model_version_create(name=root.name, config=config, path=str(root))
    return version, arrays


def job_state(pk: int) -> ConversionJob:
    return ConversionJob.objects.get(pk=pk)


@pytest.mark.postgres(reason="an agent process shares the test database")
def test_it_converts_on_the_nodes_own_queue_bit_for_bit(agents, tmp_path):
    agents()
    node = node_create(name=NODE)
    version, arrays = bf16_model(tmp_path / "qwen-bf16", tensors=3, elements=50_000)
    job = conversion_job_start(model_version=version, node=node)
    finished = ("succeeded", "failed")
    job = wait_until(lambda: (j := job_state(job.pk)).state in finished and j, timeout_s=90, what="the end")
    assert job.state == ConversionState.SUCCEEDED, job.error
    new = job.result
    assert (new.name, new.weight_dtype) == ("qwen-bf16-fp16", "float16")
    assert new.weights_sha256 == hash_model_dir(new.path).weights_sha256
    for i, bits in enumerate(arrays):
        got = fp16_bits_of(Path(new.path) / "model.safetensors", f"layer.{i}")
        assert np.array_equal(got, bf16_bits_to_fp16(bits).view(np.uint16))


@pytest.mark.slow  # out of make test-fast: seconds of work on 2 cores
@pytest.mark.postgres(reason="an agent process shares the test database")
def test_a_killed_agent_leaves_nothing_and_a_rerun_starts_clean(agents, tmp_path):
    agent = agents()
    node = node_create(name=NODE)
    # ~200 MB in 8 tensors: a few seconds of work, long enough to be killed mid-way.
    version, _ = bf16_model(tmp_path / "big-bf16", tensors=8, elements=12_500_000)
    job = conversion_job_start(model_version=version, node=node)
    target = tmp_path / "big-bf16-fp16"

    def mid_way():
        j = job_state(job.pk)
        partial = list(tmp_path.glob(".big-bf16-fp16.partial-*/model.safetensors"))
        half_way = 0 < j.bytes_done < j.bytes_total
        return j.state == "running" and j.phase == "converting" and half_way and partial

    wait_until(mid_way, timeout_s=120, what="the job to be half-way", interval_s=0.01)
    stop(agent, signal.SIGKILL)

    killed = job_state(job.pk)
    assert killed.state == ConversionState.RUNNING  # nobody could say otherwise
    assert not target.exists()
    assert not ModelVersion.objects.filter(name="big-bf16-fp16").exists()
    wait_until(
        lambda: job_state(job.pk).is_stale, timeout_s=LEASE_S + 5, what="the lease to lapse", interval_s=0.2
    )

    agents()
    rerun = conversion_job_start(model_version=version, node=node)
    rerun = wait_until(
        lambda: (j := job_state(rerun.pk)).state in ("succeeded", "failed") and j,
        timeout_s=120,
        what="the re-run to end",
    )
    assert rerun.state == ConversionState.SUCCEEDED, rerun.error
    killed.refresh_from_db()
    assert killed.state == ConversionState.FAILED and "interrupted" in killed.error
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big-bf16", "big-bf16-fp16"]
    assert rerun.result.path == str(target)
    assert rerun.result.weights_sha256 == hash_model_dir(target).weights_sha256
