"""An admission whose reply is lost to a Redis timeout (the script ran, the answer never came) is
a 503, and what the script took is given back: slots, queue places, the request and its tokens,
exactly once and only if it was taken."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from redis.asyncio import Redis
from redis.exceptions import TimeoutError as RedisTimeoutError

from portal.core.redis.keys import RedisKeys
from portal.gateway.admission import steps as admission
from portal.gateway.admission.limiter import RateLimiter
from portal.gateway.admission.records import Limits, Scope
from portal.gateway.errors import GatewayError
from tests.helpers.gateway import REDIS_URL
from tests.helpers.processes import run_async

TEAM = Scope("team", 1, Limits(tpm=1000, tokens_per_day=1000, max_concurrent=1))
KEY = Scope("key", 2, Limits(rpm=1, max_concurrent=1))


async def with_limiter(test):
    redis = Redis.from_url(REDIS_URL)
    namespace = f"test-{uuid.uuid4().hex[:8]}"
    limiter = RateLimiter(redis, keys=RedisKeys(namespace), lease_ms=30_000)
    try:
        return await test(limiter)
    finally:
        await limiter.scripts.aclose()
        keys = [k async for k in redis.scan_iter(f"{namespace}:*")]
        if keys:
            await redis.delete(*keys)
        await redis.aclose()


async def admit(limiter: RateLimiter, request_id: str):
    return await admission.admit_and_place(
        limiter, request_id=request_id, team=TEAM, key=KEY, tokens=1000, model="m",
        candidates=[(1, 1)], long_prompt=False, on_admitted=lambda _admission: None, slots=1,
    )  # fmt: skip


def test_an_admission_whose_reply_timed_out_gives_back_what_it_took():
    async def go(limiter: RateLimiter):
        real = limiter._admit_place

        async def ran_then_timed_out(**kwargs):
            await real(**kwargs)  # admitted and placed: the request, 1000 tokens, every slot taken
            raise RedisTimeoutError("Timeout reading from socket")

        limiter._admit_place = ran_then_timed_out
        with pytest.raises(GatewayError) as refused:
            await admit(limiter, "a")
        limiter._admit_place = real
        await asyncio.gather(*list(getattr(admission, "_background", ())))  # the give-back, after the 503
        # Everything "a" took is back: the key's one request a minute, the team's 1000 tokens a
        # minute and a day, both concurrency slots and the replica's only slot.
        again, grant = await admit(limiter, "b")
        twice = await limiter.give_back(request_id="a", team=TEAM, key=KEY, model="m", candidates=[(1, 1)])
        day = await limiter.redis.get(limiter.tpd_prefix(TEAM) + str(again.day))
        return refused.value.status, again.ok, grant and grant.index, twice, int(day)

    status, ok, index, twice, used_today = run_async(with_limiter(go))
    assert status == 503
    assert ok and index == 0
    # A second give-back (or one for a request never admitted) takes nothing from "b".
    assert twice is False and used_today == 1000
