"""Priority classes in the placement script, against the real Redis: a batch request takes only a
replica's spare share, waits in its own queue, and yields to any interactive request waiting."""

from __future__ import annotations

import asyncio

from portal.gateway.admission.records import batch_limit
from tests.helpers.ratelimit import run as run_with_limiter


def run(coro_fn, **limiter_options):
    """As test_ratelimit's `run`, with leases long enough that no slot a test holds lapses on a
    loaded machine."""
    return run_with_limiter(coro_fn, lease_ms=60_000, **limiter_options)


async def until_zcard(limiter, key: str, n: int, timeout_s: float = 30) -> None:
    """Until the sorted set `key` holds `n` members (a loaded machine may take a while)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while await limiter.redis.zcard(key) != n:
        assert asyncio.get_running_loop().time() < deadline, f"{key}: not {n} after {timeout_s:.0f} s"
        await asyncio.sleep(0.01)


def test_the_batch_limit_is_in_flight_below_share_times_cap_in_whole_requests():
    assert batch_limit(8, 0.5) == 4
    assert batch_limit(10, 0.3) == 3  # 3.0000000000000004 in floating point
    assert batch_limit(7, 0.5) == 4  # in flight 3 < 3.5: a fourth may start
    assert batch_limit(1, 0.5) == 1  # an idle replica of cap 1 still serves batch
    assert batch_limit(3, 1.0) == 3
    assert batch_limit(0, 0.5) == 0
    assert batch_limit(None, 0.5) is None


def test_it_gives_batch_only_its_share_of_the_cap_and_interactive_the_rest():
    async def go(limiter):
        cands = [(1, 4)]
        batch = [
            await limiter.acquire_replica(
                request_id=f"b{i}", model="m", candidates=cands, batch_share=0.5, timeout_s=0.2
            )
            for i in range(3)
        ]
        interactive = [
            await limiter.acquire_replica(request_id=f"i{i}", model="m", candidates=cands, timeout_s=0.2)
            for i in range(3)
        ]
        return [g.index for g in batch], [g.index for g in interactive], batch[2].reason

    # Two batch requests fill the share (2 of 4); the third times out in its queue, while
    # interactive requests still take the two slots left (and the next one waits).
    assert run(go) == ([0, 0, None], [0, 0, None], "queue_timeout")


def test_a_waiting_interactive_request_gets_the_freed_slot_before_an_earlier_queued_batch_one():
    async def go(limiter):
        cands = [(1, 2)]
        share = {"batch_share": 1.0}  # the share never binds here: only the yield rule orders them
        await limiter.acquire_replica(request_id="a", model="m", candidates=cands)
        await limiter.acquire_replica(request_id="b", model="m", candidates=cands)
        batch = asyncio.create_task(
            limiter.acquire_replica(request_id="c", model="m", candidates=cands, timeout_s=30, **share)
        )
        await until_zcard(limiter, limiter.queue_key("m", batch=True), 1)
        interactive = asyncio.create_task(
            limiter.acquire_replica(request_id="d", model="m", candidates=cands, timeout_s=30)
        )
        await until_zcard(limiter, limiter.queue_key("m"), 1)
        await limiter.finish(request_id="a", deployment_id=1)
        first = await interactive
        still_waiting = not batch.done() and await limiter.redis.zcard(limiter.queue_key("m", batch=True))
        await limiter.finish(request_id="b", deployment_id=1)
        second = await batch
        return first.index, still_waiting, second.index

    assert run(go) == (0, 1, 0)


def test_an_interactive_request_never_waits_behind_queued_batch_ones():
    async def go(limiter):
        cands = [(1, 2)]
        await limiter.acquire_replica(request_id="b1", model="m", candidates=cands, batch_share=0.5)
        waiting = asyncio.create_task(
            limiter.acquire_replica(
                request_id="b2", model="m", candidates=cands, batch_share=0.5, timeout_s=30
            )
        )
        await until_zcard(limiter, limiter.queue_key("m", batch=True), 1)
        interactive = await limiter.acquire_replica(
            request_id="i", model="m", candidates=cands, timeout_s=0.2
        )
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        return interactive.index, await limiter.redis.zcard(limiter.queue_key("m", batch=True))

    assert run(go) == (0, 0)


def test_an_abandoned_interactive_queue_entry_does_not_hold_batch_back_for_ever():
    async def go(limiter):
        # A dead process's entry, older than the interactive deadline plus a lease.
        now_ms = (await limiter.redis.time())[0] * 1000
        await limiter.redis.zadd(limiter.queue_key("m"), {"ghost": now_ms - 120_000})
        grant = await limiter.acquire_replica(
            request_id="b", model="m", candidates=[(1, 2)], batch_share=0.5, timeout_s=0.2,
            interactive_timeout_s=1,
        )  # fmt: skip
        return grant.index, await limiter.redis.zcard(limiter.queue_key("m"))

    assert run(go) == (0, 0)


def test_a_batch_request_cancelled_while_queued_leaves_the_batch_queue():
    async def go(limiter):
        cands = [(1, 1)]
        await limiter.acquire_replica(request_id="a", model="m", candidates=cands)
        waiting = asyncio.create_task(
            limiter.acquire_replica(request_id="b", model="m", candidates=cands, batch_share=0.5)
        )
        await until_zcard(limiter, limiter.queue_key("m", batch=True), 1)
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        return await limiter.redis.zcard(limiter.queue_key("m", batch=True))

    assert run(go) == 0


def test_a_slot_freed_in_this_process_wakes_its_waiters_at_once_interactive_first():
    """The waiters poll 30 s apart here, so only the wake-up can place them within the 10 s the
    test allows: first the interactive one, then (at the next release) the earlier batch one."""

    async def go(limiter):
        cands = [(1, 1)]
        await limiter.acquire_replica(request_id="a", model="m", candidates=cands)
        batch = asyncio.create_task(
            limiter.acquire_replica(
                request_id="b", model="m", candidates=cands, timeout_s=60, batch_share=1.0
            )
        )
        await until_zcard(limiter, limiter.queue_key("m", batch=True), 1)
        interactive = asyncio.create_task(
            limiter.acquire_replica(request_id="i", model="m", candidates=cands, timeout_s=60)
        )
        await until_zcard(limiter, limiter.queue_key("m"), 1)
        await limiter.finish(request_id="a", deployment_id=1)
        first = await asyncio.wait_for(interactive, 10)
        batch_still_waiting = not batch.done()
        await limiter.finish(request_id="i", deployment_id=1)
        second = await asyncio.wait_for(batch, 10)
        return first.index, batch_still_waiting, second.index

    assert run(go, poll_s=(30, 30)) == (0, True, 0)
