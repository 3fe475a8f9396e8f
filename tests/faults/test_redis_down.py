"""Redis stops while the gateway is under load.

The gateway's quotas, slots and queues live in Redis; without it no limit can be checked, so
the gateway refuses new requests with 503 `rate_limiter_unavailable` and a Retry-After (never
admits them unlimited). Streams already admitted carry on to their end: their upstream does not
need Redis; only their closing record is lost (logged). When Redis comes back on the same
address, requests are admitted again without restarting the web process.
"""

from __future__ import annotations

import asyncio
import json
import signal
import statistics
import time
from dataclasses import dataclass

import httpx
import pytest

from devtools import stop, wait_until
from portal.core.redis.client import redis_keys
from tests.helpers.gateway import chat_body, make_setup, slots_in_use
from tests.helpers.processes import run_async

from .conftest import shared_database_url, start_web

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.faults]

CLIENTS = 24
STREAM = "FAKE chunks=30 interval=20"  # each stream lasts ~0.6 s


@dataclass
class Outcome:
    started: float
    ended: float
    status: int
    code: str = ""  # the error code of a refusal, or of an error event in a stream
    retry_after: str | None = None
    done: bool = False  # a stream that ended with [DONE]
    events: int = 0


async def one_request(client: httpx.AsyncClient, url: str, headers: dict, body: dict) -> Outcome:
    started = time.monotonic()
    async with client.stream("POST", f"{url}/v1/chat/completions", headers=headers, json=body) as response:
        if response.status_code != 200:
            raw = await response.aread()
            try:
                code = json.loads(raw)["error"]["code"]
            except (ValueError, KeyError, TypeError):
                code = f"not OpenAI-shaped: {raw[:200]!r}"
            retry_after = response.headers.get("retry-after")
            return Outcome(started, time.monotonic(), response.status_code, code, retry_after)
        outcome = Outcome(started, 0.0, 200)
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                outcome.done = True
            elif '"error"' in data:
                outcome.code = json.loads(data)["error"]["code"]
            else:
                outcome.events += 1
        outcome.ended = time.monotonic()
        return outcome


async def load(web_url: str, headers: dict, model: str, fault) -> tuple[list[Outcome], dict[str, float]]:
    """CLIENTS closed-loop streaming clients while `fault(marks, outcomes)` runs; every request is
    recorded in `outcomes` as it ends."""
    outcomes: list[Outcome] = []
    marks: dict[str, float] = {}
    running = True
    body = chat_body(model, STREAM, stream=True)

    async def client_loop(client: httpx.AsyncClient) -> None:
        while running:
            try:
                outcome = await one_request(client, web_url, headers, body)
            except httpx.HTTPError as error:  # a hang or a dropped connection is a failure of the test
                outcome = Outcome(time.monotonic(), time.monotonic(), 0, f"client error: {error!r}")
            outcomes.append(outcome)
            if outcome.status != 200:
                await asyncio.sleep(0.05)  # a refused client retries soon, not in a hot loop

    limits = httpx.Limits(max_connections=CLIENTS + 4)
    async with httpx.AsyncClient(limits=limits, timeout=15) as client:
        tasks = [asyncio.create_task(client_loop(client)) for _ in range(CLIENTS)]
        await fault(marks, outcomes)
        running = False
        await asyncio.gather(*tasks)
    return outcomes, marks


def test_redis_stopping_under_load_gives_clear_503s_then_service_resumes_by_itself(
    transactional_db, team, cpu_node, fake_upstream, private_redis, tmp_path
):
    setup = make_setup(team=team, node=cpu_node, upstream=fake_upstream, key_kwargs={"max_concurrent": 64})
    web = start_web(
        tmp_path / "web.log",
        {
            "DATABASE_URL": shared_database_url(),
            "REDIS_URL": private_redis.url,
            "GATEWAY_REDIS_URL": private_redis.url,
            "GATEWAY_REDIS_TIMEOUT_S": "1",
        },
    )

    async def until(done, what: str, timeout_s: float = 60) -> None:
        # Each phase lasts until its requests happened, not a fixed time: a loaded machine is slower.
        deadline = time.monotonic() + timeout_s
        while not done():
            assert time.monotonic() < deadline, f"not {what} after {timeout_s:.0f} s"
            await asyncio.sleep(0.05)

    async def fault(marks: dict[str, float], outcomes: list[Outcome]) -> None:
        await until(lambda: sum(o.status == 200 for o in outcomes) >= CLIENTS, "streams served")
        marks["killed"] = time.monotonic()
        await asyncio.to_thread(private_redis.kill, signal.SIGKILL)
        await until(
            lambda: sum(o.started > marks["killed"] + 0.05 for o in outcomes) >= 2 * CLIENTS,
            "requests refused while Redis is down",
        )
        marks["restarting"] = time.monotonic()
        await asyncio.to_thread(private_redis.start)
        marks["restarted"] = time.monotonic()
        await until(
            lambda: sum(o.started > marks["restarted"] + 1 and o.status == 200 for o in outcomes) >= CLIENTS,
            "streams served after the restart",
        )

    try:
        outcomes, marks = run_async(load(web.url, setup.headers, setup.model, fault))
        log = web.log_text()
    finally:
        stop(web.process)

    killed, restarted = marks["killed"], marks["restarted"]
    before = [o for o in outcomes if o.ended < killed]
    down = [o for o in outcomes if o.started > killed + 0.05 and o.ended < marks["restarting"]]
    in_flight = [o for o in outcomes if o.started < killed < o.ended]
    after = [o for o in outcomes if o.started > restarted]
    refused = [o for o in outcomes if o.status == 503]
    first_ok_after = min((o.ended for o in after if o.status == 200), default=None)
    refusal_s = sorted(o.ended - o.started for o in down)
    print(
        f"\n{len(outcomes)} requests: {len(before)} before the kill, {len(in_flight)} in flight at it, "
        f"{len(down)} while Redis was down, {len(after)} after it came back; statuses "
        f"{ {s: [o.status for o in outcomes].count(s) for s in {o.status for o in outcomes}} }; "
        f"refusals took {statistics.median(refusal_s or [0]):.2f} s (median), {max(refusal_s or [0]):.2f} s "
        f"at most; first success {first_ok_after - restarted:.2f} s after Redis answered again"
        if first_ok_after
        else "\nno success after the restart"
    )

    # Every request got an answer: a complete stream or a clear 503; no 500, no hang.
    for o in outcomes:
        assert (o.status == 200 and o.done and not o.code) or (
            o.status == 503 and o.code == "rate_limiter_unavailable" and o.retry_after
        ), o
    assert before and all(o.status == 200 for o in before)
    # Never unlimited: nothing started while Redis was down was admitted.
    assert len(down) >= CLIENTS and all(o.status == 503 for o in down)
    # Refused at once, not after redis-py's default retries (backoffs of up to 2, 4 and 8 s): mostly
    # within a second or two, and none near a hang even when the loaded machine stalls the web process.
    assert statistics.median(refusal_s) < 2 and refusal_s[-1] < 10, refusal_s  # seen: 0.46, 2.24 s
    assert refused and all(int(o.retry_after) >= 1 for o in refused)
    # Streams admitted before the kill ran to their end; their closing record was lost, and said so.
    # (each 200 is a whole stream, checked above; one still waiting for its admission reply got a 503)
    assert [o for o in in_flight if o.status == 200]
    assert "usage not recorded for request" in log
    # Service resumed by itself (same uvicorn process): everything started a second after is admitted.
    assert first_ok_after is not None and first_ok_after - restarted < 5
    assert all(o.status == 200 for o in after if o.started > restarted + 1)

    # The new Redis holds the admitted requests' records and no slot is left taken.
    client = private_redis.client()
    wait_until(lambda: not any(slots_in_use(client, setup).values()), timeout_s=30, what="slots free")
    records = [json.loads(r) for r in client.lrange(redis_keys().usage, 0, -1)]
    # (a refusal whose closing step ran once Redis answered again is recorded too, as an outage:
    # the portal's Redis was down, not the caller's quota)
    assert {(r["status"], r["error_code"]) for r in records} <= {
        ("completed", ""),
        ("unavailable", "rate_limiter_unavailable"),
    }
    assert sum(r["status"] == "completed" for r in records) >= len([o for o in after if o.status == 200])
    client.close()


def test_a_hung_redis_gives_503s_after_one_timeout_not_a_hang(
    transactional_db, team, cpu_node, fake_upstream, private_redis, tmp_path
):
    """SIGSTOP: Redis accepts connections but never answers (a partition, a frozen VM)."""
    setup = make_setup(team=team, node=cpu_node, upstream=fake_upstream)
    web = start_web(
        tmp_path / "web.log",
        {
            "DATABASE_URL": shared_database_url(),
            "REDIS_URL": private_redis.url,
            "GATEWAY_REDIS_TIMEOUT_S": "1",
        },
    )

    async def burst(n: int) -> list[Outcome]:
        body = chat_body(setup.model, STREAM, stream=True)
        async with httpx.AsyncClient(timeout=15) as client:
            return await asyncio.gather(
                *[one_request(client, web.url, setup.headers, body) for _ in range(n)]
            )

    try:
        assert [o.status for o in run_async(burst(4))] == [200] * 4
        private_redis.kill(signal.SIGSTOP)
        frozen = run_async(burst(8))
        private_redis.kill(signal.SIGCONT)
        thawed = time.monotonic()
        recovered = wait_until(
            lambda: all(o.status == 200 for o in run_async(burst(4))), timeout_s=30, what="admitted again"
        )
        print(
            f"\nRedis frozen: {[o.status for o in frozen]} in "
            f"{max(o.ended - o.started for o in frozen):.2f} s at most; admitted again "
            f"{time.monotonic() - thawed:.2f} s after SIGCONT"
        )
    finally:
        stop(web.process)
    assert all(o.status == 503 and o.code == "rate_limiter_unavailable" and o.retry_after for o in frozen)
    # Two 1 s timeouts at most (admission, then the closing record); a timed-out script is not retried.
    assert all(o.ended - o.started < 4 for o in frozen)
    assert recovered
