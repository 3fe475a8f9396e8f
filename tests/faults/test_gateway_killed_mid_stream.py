"""The gateway process is killed (SIGKILL) while a client streams through it.

Nothing of the process runs after the kill: no `finally`, no usage record of its own. The
request's open record, left in Redis at admission, is queued by the usage flush once its lease
lapses (nobody renews it any more): one `interrupted` row billing the reservation, which the day's
counter still holds, so the database and the counter agree."""

from __future__ import annotations

import os
import signal

import httpx
import pytest
from django.utils import timezone

from devtools import stop, wait_until
from portal.core.redis.client import redis_keys
from portal.teams.models import Usage
from portal.teams.services import usage_flush
from tests.helpers.gateway import chat_body, make_setup, start_gateway

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.faults]

MAX_TOKENS = 400
LONG_STREAM = "FAKE chunks=400 interval=50"  # 20 s of tokens: the kill lands mid-stream


def test_a_request_whose_gateway_was_killed_mid_stream_leaves_an_interrupted_row_matching_the_counter(
    team, cpu_node, fake_upstream, gw_redis, tmp_path
):
    setup = make_setup(team=team, node=cpu_node, upstream=fake_upstream)
    team.tokens_per_day = 100_000  # so the day's counter exists
    team.save()
    gateway, process = start_gateway(
        tmp_path / "gateway.log", GATEWAY_SLOT_LEASE_S="1.5", GATEWAY_REDIS_TIMEOUT_S="0.5"
    )
    try:
        body = chat_body(setup.model, LONG_STREAM, stream=True, max_tokens=MAX_TOKENS)
        with httpx.stream(
            "POST", f"{gateway.url}/v1/chat/completions", headers=setup.headers, json=body, timeout=30
        ) as response:
            assert response.status_code == 200
            first = next(response.iter_bytes())
            assert first.startswith(b"data: ")
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    finally:
        if process.poll() is None:
            stop(process)

    def stored() -> list[Usage]:
        usage_flush()
        return list(Usage.objects.filter(team=team))

    [row] = wait_until(stored, what="the interrupted request's row", timeout_s=20)
    day = int(timezone.now().timestamp() // 86400)
    counter = int(gw_redis.get(redis_keys().tpd_prefix("team", team.pk) + str(day)))
    assert (row.status, row.error_code) == ("interrupted", "gateway_interrupted")
    assert row.completion_tokens == MAX_TOKENS
    assert row.prompt_tokens + row.completion_tokens == counter
