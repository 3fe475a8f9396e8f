"""The Redis rate limiter on a namespace of its own, for the limiter's tests."""

from __future__ import annotations

import os
import uuid

from redis.asyncio import Redis

from portal.core.redis.keys import RedisKeys
from portal.gateway.admission.limiter import RateLimiter
from tests.helpers.processes import run_async

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/15")


def run(coro_fn, *, lease_ms: int = 2000, poll_s: tuple[float, float] = (0.002, 0.05), daily_used=None):
    """Run `coro_fn(limiter)` on a fresh event loop with a limiter under a unique namespace."""

    async def main():
        redis = Redis.from_url(REDIS_URL)
        namespace = f"test-{uuid.uuid4().hex[:8]}"
        try:
            limiter = RateLimiter(
                redis, keys=RedisKeys(namespace), lease_ms=lease_ms, poll_s=poll_s, daily_used=daily_used
            )
            try:
                return await coro_fn(limiter)
            finally:
                await limiter.scripts.aclose()
        finally:
            keys = [k async for k in redis.scan_iter(f"{namespace}:*")]
            if keys:
                await redis.delete(*keys)
            await redis.aclose()

    # In a thread of its own: the test thread may already run a loop (Playwright's sync API does).
    return run_async(main())
