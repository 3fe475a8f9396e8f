"""A streamed answer ends for its client before the gateway accounts for it (issue 39).

The accounting (leave the slots, correct the tokens, queue the usage record: one Redis script)
runs after the response's end is sent, still exactly once. Shown with a Redis frozen (SIGSTOP)
from the first chunk on: the client still reads `[DONE]` and the end of the body, and the record
is queued, once, when Redis thaws.
"""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from devtools import stop, wait_until
from portal.core.redis.client import redis_keys
from tests.helpers.gateway import chat_body, make_setup

from .conftest import shared_database_url, start_web

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.faults]

FROZEN_S = 4.0  # longer than a stream of this test takes, shorter than the gateway's Redis timeout


def test_it_ends_the_stream_for_the_client_before_accounting_for_it(
    transactional_db, team, cpu_node, fake_upstream, private_redis, tmp_path
):
    setup = make_setup(team=team, node=cpu_node, upstream=fake_upstream)
    web = start_web(
        tmp_path / "web.log",
        {
            "DATABASE_URL": shared_database_url(),
            "REDIS_URL": private_redis.url,
            "GATEWAY_REDIS_URL": private_redis.url,
            "GATEWAY_REDIS_TIMEOUT_S": "10",
        },
    )
    thaw = threading.Timer(FROZEN_S, lambda: private_redis.kill(signal.SIGCONT))
    body = chat_body(setup.model, "FAKE chunks=8 interval=20", stream=True)
    try:
        url = f"{web.url}/v1/chat/completions"
        with httpx.stream("POST", url, headers=setup.headers, json=body, timeout=30) as response:
            assert response.status_code == 200
            request_id = response.headers["x-request-id"]
            lines = response.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            private_redis.kill(signal.SIGSTOP)  # admitted: no Redis call until the accounting
            frozen_at = time.monotonic()
            thaw.start()
            rest = [line for line in lines if line.startswith("data: ")]
            ended_after_s = time.monotonic() - frozen_at
        thawed = thaw.finished.wait(timeout=FROZEN_S + 5)
        usage = private_redis.client()
        key = redis_keys().usage

        def records() -> list[dict]:
            mine = [json.loads(raw) for raw in usage.lrange(key, 0, -1)]
            return [m for m in mine if m["request_id"] == request_id.replace("-", "")]

        queued = wait_until(records, timeout_s=15, what="the stream's usage record")
        # Queued in the same script that forgets the open record (left in case the process died).
        open_records = usage.hlen(redis_keys().usage_open)
    finally:
        thaw.cancel()
        private_redis.kill(signal.SIGCONT)
        stop(web.process)
    assert '"content"' in first and rest[-1] == "data: [DONE]"
    # The body ended while Redis was still frozen: the client waited for no accounting.
    assert thawed and ended_after_s < FROZEN_S - 1, f"the body ended {ended_after_s:.2f} s after the freeze"
    assert len(queued) == 1 and open_records == 0
    assert queued[0]["status"] == "completed" and queued[0]["http_status"] == 200
