"""Validation before anything runs: every line checked with the gateway's own rules; any bad line
fails the batch, each reported in `errors` with its line number, as OpenAI's does."""

from __future__ import annotations

import json

import httpx
import pytest

from devtools import stop
from portal.batches.lifecycle import batch_validate
from portal.batches.models import Batch, BatchLine, BatchStatus
from portal.batches.services import batch_create, file_create
from tests.helpers import builders
from tests.helpers.batches import SIM_MODEL, input_lines, jsonl
from tests.helpers.gateway import start_gateway

pytestmark = [pytest.mark.django_db]


@pytest.fixture
def key(team):
    return builders.api_key(team, models=[SIM_MODEL])[0]


def validated(team, key, content: bytes, endpoint: str = "/v1/chat/completions") -> Batch:
    file = file_create(team=team, filename="in.jsonl", content=content, purpose="batch")
    batch = batch_create(
        team=team, api_key=key, input_file_id=file.public_id, endpoint=endpoint, completion_window="24h"
    )
    batch_validate(batch_id=batch.pk)
    batch.refresh_from_db()
    return batch


def test_it_fails_a_file_with_bad_lines_naming_each_line_and_stores_none(team, key):
    good = input_lines(1)[0]
    lines = [
        json.dumps(good),
        "{not json",
        json.dumps(good),  # the same custom_id again
        json.dumps({**good, "custom_id": "u", "url": "/v1/completions"}),
        json.dumps({**good, "custom_id": "m", "method": "GET"}),
        json.dumps({**good, "custom_id": "x", "body": {**good["body"], "model": "not-mine"}}),
        json.dumps({**good, "custom_id": "p", "body": {**good["body"], "temprature": 1}}),
        json.dumps({**good, "custom_id": "s", "body": {**good["body"], "stream": True}}),
        "",
        json.dumps({**good, "custom_id": "n", "body": {**good["body"], "n": 99}}),
    ]
    batch = validated(team, key, "\n".join(lines).encode())
    assert batch.status == BatchStatus.FAILED and batch.failed_at is not None
    found = {(error["line"], error["code"], error["param"]) for error in batch.errors["data"]}
    assert found == {
        (2, "invalid_json_line", None),
        (3, "duplicate_custom_id", "custom_id"),
        (4, "invalid_url", "url"),
        (5, "invalid_method", "method"),
        (6, "model_not_allowed", "body.model"),
        (7, "unknown_parameter", "body.temprature"),
        (8, "invalid_body", "body.stream"),
        (10, "invalid_value", "body.n"),
    }
    assert batch.errors["object"] == "list"
    assert not BatchLine.objects.filter(batch=batch).exists()


def test_it_starts_a_valid_file_with_max_tokens_bounded_as_the_gateway_bounds_it(team, key):
    team.max_tokens_clamp = 16
    team.save()
    lines = input_lines(3, max_tokens=100_000)
    batch = validated(team, key, jsonl(lines))
    assert batch.status == BatchStatus.IN_PROGRESS, batch.errors
    assert batch.request_total == 3 and batch.in_progress_at is not None
    stored = list(BatchLine.objects.filter(batch=batch).order_by("line_number"))
    assert [(line.line_number, line.custom_id) for line in stored] == [
        (1, "req-0"),
        (2, "req-1"),
        (3, "req-2"),
    ]


def test_it_fails_a_file_over_the_line_count_or_a_line_over_its_size(team, key, settings):
    settings.BATCH_MAX_LINES = 2
    batch = validated(team, key, jsonl(input_lines(3)))
    assert [error["code"] for error in batch.errors["data"]] == ["too_many_requests"]
    settings.BATCH_MAX_LINES = 10
    settings.BATCH_LINE_MAX_BYTES = 256
    long = input_lines(1)[0]
    long["body"]["messages"][0]["content"] = "x" * 300
    batch = validated(team, key, jsonl([input_lines(1)[0] | {"custom_id": "short"}, long]))
    assert [(e["line"], e["code"]) for e in batch.errors["data"]] == [(2, "line_too_large")]


def test_it_refuses_an_empty_file_and_a_completions_line_without_a_prompt(team, key):
    assert validated(team, key, b"\n\n").errors["data"][0]["code"] == "empty_file"
    line = {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"model": SIM_MODEL}}
    batch = validated(team, key, jsonl([line]), endpoint="/v1/completions")
    assert [(e["line"], e["code"], e["param"]) for e in batch.errors["data"]] == [
        (1, "missing_parameter", "body.prompt")
    ]


@pytest.mark.django_db(transaction=True)
def test_an_upload_over_batch_file_max_bytes_is_refused_at_the_edge(team, key, tmp_path):
    _, token = builders.api_key(team)
    gateway, process = start_gateway(tmp_path / "gateway.log", BATCH_FILE_MAX_BYTES="2048")
    try:
        headers = {"Authorization": f"Bearer {token}"}
        small = httpx.post(f"{gateway.url}/v1/files", headers=headers, data={"purpose": "batch"},
                           files={"file": ("in.jsonl", b"x" * 1024)})  # fmt: skip
        assert small.status_code == 200, small.text
        big = httpx.post(f"{gateway.url}/v1/files", headers=headers, data={"purpose": "batch"},
                         files={"file": ("in.jsonl", b"x" * 200_000)})  # fmt: skip
        assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
        wrong = httpx.post(f"{gateway.url}/v1/files", headers=headers, data={"purpose": "fine-tune"},
                           files={"file": ("in.jsonl", b"x")})  # fmt: skip
        assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "purpose"
    finally:
        stop(process)
