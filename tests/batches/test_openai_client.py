"""The official `openai` client, unchanged, against the portal: upload a file, create a batch, poll
it to `completed`, download its output. A real gateway (uvicorn), a real Celery worker on the
batches queue, the simulator as the upstream."""

from __future__ import annotations

import httpx
import openai
import pytest

from devtools import stop, wait_until
from tests.helpers import builders
from tests.helpers.batches import (
    empty_batch_queue,
    input_lines,
    jsonl,
    read_jsonl,
    serve_sim,
    start_batch_worker,
    start_sim,
    usage_of,
)

pytestmark = [pytest.mark.django_db(transaction=True)]

ENDED = {"completed", "failed", "expired", "cancelled"}


@pytest.fixture
def sim():
    url, process = start_sim()
    yield url
    stop(process)


@pytest.fixture
def batch_worker(tmp_path):
    empty_batch_queue()
    log = tmp_path / "worker.log"
    worker = start_batch_worker(log)
    yield log
    if worker.poll() is None:
        stop(worker)


@pytest.mark.timeout(300)
def test_it_runs_a_batch_from_the_openai_client_and_writes_every_custom_id_once(
    gateway, gw_redis, team, cpu_node, sim, batch_worker
):
    setup = serve_sim(team=team, node=cpu_node, upstream=sim)
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=setup.token, max_retries=0)
    lines = input_lines(30)
    uploaded = client.files.create(file=("input.jsonl", jsonl(lines)), purpose="batch")
    assert uploaded.purpose == "batch" and uploaded.bytes == len(jsonl(lines))
    assert client.files.retrieve(uploaded.id).filename == "input.jsonl"
    batch = client.batches.create(
        input_file_id=uploaded.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"job": "labels"},
    )
    assert batch.status == "validating" and batch.metadata == {"job": "labels"}

    def ended():
        found = client.batches.retrieve(batch.id)
        return found if found.status in ENDED else None

    done = wait_until(
        ended, timeout_s=240, interval_s=0.5, what=f"the batch ended\n{batch_worker.read_text()[-3000:]}"
    )
    assert done.status == "completed", done.errors
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (
        30,
        30,
        0,
    )
    assert done.error_file_id is None
    output = read_jsonl(client.files.content(done.output_file_id).content)
    custom_ids = [line["custom_id"] for line in output]
    assert sorted(custom_ids) == sorted(line["custom_id"] for line in lines)  # each once, none lost
    assert all(line["response"]["status_code"] == 200 and line["error"] is None for line in output)
    assert all(line["response"]["body"]["choices"][0]["message"]["content"] for line in output)
    rows = list(usage_of(batch.id))
    assert len(rows) == 30 and len({row.request_id for row in rows}) == 30
    assert {(row.source, row.priority_class, row.status) for row in rows} == {("batch", "batch", "completed")}
    assert sum(row.completion_tokens for row in rows) == sum(
        line["response"]["body"]["usage"]["completion_tokens"] for line in output
    )
    assert [b.id for b in client.batches.list(limit=5)] == [batch.id]


def test_another_teams_file_and_batch_are_not_found(gateway, gw_redis, team, cpu_node, charlie):
    setup = serve_sim(team=team, node=cpu_node, upstream="http://127.0.0.1:9")
    _, other_token = builders.api_key(builders.team("Other", members=[charlie]))
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=setup.token, max_retries=0)
    uploaded = client.files.create(file=("in.jsonl", jsonl(input_lines(1))), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    other = {"Authorization": f"Bearer {other_token}"}
    for method, path in [
        ("GET", f"/v1/files/{uploaded.id}"),
        ("GET", f"/v1/files/{uploaded.id}/content"),
        ("DELETE", f"/v1/files/{uploaded.id}"),
        ("GET", f"/v1/batches/{batch.id}"),
        ("POST", f"/v1/batches/{batch.id}/cancel"),
    ]:
        answer = httpx.request(method, f"{gateway.url}{path}", headers=other)
        assert answer.status_code == 404, (path, answer.text)
        assert answer.json()["error"]["code"] == "not_found"
    listed = httpx.get(f"{gateway.url}/v1/batches", headers=other).json()
    assert listed["data"] == [] and listed["has_more"] is False
    no_key = httpx.get(f"{gateway.url}/v1/files")
    assert no_key.status_code == 401 and no_key.json()["error"]["code"] == "missing_api_key"


def test_the_openai_client_lists_deletes_and_cancels(gateway, gw_redis, team, cpu_node):
    from portal.batches.models import Batch

    setup = serve_sim(team=team, node=cpu_node, upstream="http://127.0.0.1:9")
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=setup.token, max_retries=0)
    uploaded = [
        client.files.create(file=(f"in{n}.jsonl", jsonl(input_lines(1))), purpose="batch") for n in range(3)
    ]
    assert [f.id for f in client.files.list(purpose="batch")] == [f.id for f in reversed(uploaded)]
    page = client.files.list(limit=2)
    assert [f.id for f in page.data] == [uploaded[2].id, uploaded[1].id] and page.has_more
    assert client.files.delete(uploaded[0].id).deleted is True
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(uploaded[0].id)
    batch = client.batches.create(
        input_file_id=uploaded[1].id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    cancelled = client.batches.cancel(batch.id)
    assert cancelled.status == "cancelling" and cancelled.cancelling_at is not None
    assert Batch.objects.get(public_id=batch.id).status == "cancelling"
    with pytest.raises(openai.BadRequestError, match="completion_window"):
        client.batches.create(
            input_file_id=uploaded[1].id, endpoint="/v1/chat/completions", completion_window="1h"
        )
    with pytest.raises(openai.BadRequestError, match="endpoint"):
        client.batches.create(
            input_file_id=uploaded[1].id, endpoint="/v1/embeddings", completion_window="24h"
        )


def test_a_mistyped_batches_path_is_the_gateways_json_404_naming_it(gateway):
    answer = httpx.get(f"{gateway.url}/v1/batchs")
    assert answer.status_code == 404
    assert "Did you mean /v1/batches?" in answer.json()["error"]["message"]
