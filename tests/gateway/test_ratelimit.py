"""The Redis rate-limit scripts against the real Redis (REDIS_URL's database)."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from portal.gateway.admission.leases import LeaseKeeper
from portal.gateway.admission.limiter import RateLimiter
from portal.gateway.admission.records import Limits, Scope
from tests.helpers.ratelimit import run


def rid() -> str:
    return uuid.uuid4().hex


async def until_queued(limiter: RateLimiter, model: str, n: int, timeout_s: float = 30) -> None:
    """Until `n` requests wait in the model's queue (a loaded machine may take a while to get there)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while await limiter.redis.zcard(limiter.queue_key(model)) != n:
        assert asyncio.get_running_loop().time() < deadline, f"not {n} queued after {timeout_s:.0f} s"
        await asyncio.sleep(0.01)


def team(**limits) -> Scope:
    return Scope("team", 1, Limits(**limits))


KEY = Scope("key", 7)


def test_it_admits_exactly_the_concurrency_limit_of_50_simultaneous_requests():
    async def go(limiter):
        results = await asyncio.gather(
            *[
                limiter.admit(request_id=rid(), team=team(max_concurrent=10), key=KEY, tokens=10)
                for _ in range(50)
            ]
        )
        return [r.ok for r in results], {r.reason for r in results if not r.ok}

    oks, reasons = run(go)
    assert oks.count(True) == 10
    assert reasons == {"team_concurrency"}


def test_it_frees_a_concurrency_slot_when_the_request_finishes():
    async def go(limiter):
        scope = team(max_concurrent=1)
        first = rid()
        admission = await limiter.admit(request_id=first, team=scope, key=KEY, tokens=1)
        blocked = await limiter.admit(request_id=rid(), team=scope, key=KEY, tokens=1)
        await limiter.finish(request_id=first, team=scope, key=KEY, admission=admission, used_tokens=1)
        again = await limiter.admit(request_id=rid(), team=scope, key=KEY, tokens=1)
        return admission.ok, blocked.ok, again.ok

    assert run(go) == (True, False, True)


def test_it_expires_a_slot_whose_lease_is_not_renewed():
    async def go(limiter):
        scope = team(max_concurrent=1)
        await limiter.admit(request_id=rid(), team=scope, key=KEY, tokens=1)  # "crashed": never finishes
        blocked = await limiter.admit(request_id=rid(), team=scope, key=KEY, tokens=1)
        await asyncio.sleep(2.1)
        after = await limiter.admit(request_id=rid(), team=scope, key=KEY, tokens=1)
        return blocked.ok, after.ok

    assert run(go) == (False, True)


def test_it_keeps_a_renewed_lease():
    async def go(limiter):
        scope = team(max_concurrent=1)
        keeper = LeaseKeeper(limiter)
        first = rid()
        await limiter.admit(request_id=first, team=scope, key=KEY, tokens=1)
        keeper.hold([limiter.concurrency_key(scope)], first)
        await asyncio.sleep(2.5)
        blocked = await limiter.admit(request_id=rid(), team=scope, key=KEY, tokens=1)
        keeper.drop([limiter.concurrency_key(scope)], first)
        return blocked.ok

    assert run(go) is False


def test_it_limits_requests_per_minute_with_a_retry_after():
    async def go(limiter):
        results = [
            await limiter.admit(request_id=rid(), team=team(rpm=5), key=KEY, tokens=0) for _ in range(6)
        ]
        return results

    results = run(go)
    assert [r.ok for r in results] == [True] * 5 + [False]
    assert results[-1].reason == "team_rpm"
    assert 0 < results[-1].retry_after_s <= 12.001  # one emission interval: 60 s / 5


def test_it_applies_the_key_limits_as_well_as_the_teams():
    async def go(limiter):
        key = Scope("key", 8, Limits(rpm=2))
        return [
            (await limiter.admit(request_id=rid(), team=team(rpm=100), key=key, tokens=0)) for _ in range(3)
        ]

    results = run(go)
    assert [r.ok for r in results] == [True, True, False]
    assert results[-1].reason == "key_rpm"


def test_it_reserves_tokens_and_corrects_them_to_actual_use():
    async def go(limiter):
        scope = team(tpm=1000)
        first = await limiter.admit(request_id="a", team=scope, key=KEY, tokens=900)
        refused = await limiter.admit(request_id="b", team=scope, key=KEY, tokens=200)
        await limiter.finish(request_id="a", team=scope, key=KEY, admission=first, used_tokens=100)
        after = await limiter.admit(request_id="c", team=scope, key=KEY, tokens=800)
        return first.ok, refused.reason, after.ok

    assert run(go) == (True, "team_tpm", True)


def test_it_remembers_a_tokens_per_minute_over_use_until_its_clock_has_passed():
    async def go(limiter):
        scope = team(tpm=60)  # one token a second
        first = await limiter.admit(request_id="a", team=scope, key=KEY, tokens=1)
        # It used three minutes of budget: the clock moves far past the TTL set at admission (~61 s).
        await limiter.finish(request_id="a", team=scope, key=KEY, admission=first, used_tokens=180)
        seconds, micros = await limiter.redis.time()
        now_ms = seconds * 1000 + micros // 1000
        ahead_ms = float(await limiter.redis.get(limiter.tpm_key(scope))) - now_ms
        ttl_ms = await limiter.redis.pttl(limiter.tpm_key(scope))
        refused = await limiter.admit(request_id="b", team=scope, key=KEY, tokens=1)
        return ahead_ms, ttl_ms, refused

    ahead_ms, ttl_ms, refused = run(go)
    assert ahead_ms > 170_000
    assert ttl_ms >= ahead_ms  # the key, and the debt it records, outlives the clock
    assert (refused.reason, refused.retry_after_s > 100) == ("team_tpm", True)


def test_it_refuses_a_request_larger_than_the_whole_minute_budget_for_good():
    async def go(limiter):
        return await limiter.admit(request_id=rid(), team=team(tpm=100), key=KEY, tokens=101)

    admission = run(go)
    assert (admission.ok, admission.reason, admission.retry_after_s) == (False, "team_tpm_too_large", -1.0)


def test_it_counts_tokens_per_day_and_refunds_unused_ones():
    async def go(limiter):
        scope = team(tokens_per_day=1000)
        first = await limiter.admit(request_id="a", team=scope, key=KEY, tokens=600)
        refused = await limiter.admit(request_id="b", team=scope, key=KEY, tokens=600)
        await limiter.finish(request_id="a", team=scope, key=KEY, admission=first, used_tokens=300)
        after = await limiter.admit(request_id="c", team=scope, key=KEY, tokens=600)
        used = await limiter.redis.get(limiter.tpd_prefix(scope) + str(first.day))
        return refused.reason, refused.retry_after_s, after.ok, int(used)

    reason, retry, ok, used = run(go)
    assert reason == "team_tpd"
    assert 0 < retry <= 86400
    assert ok and used == 900


def test_it_refuses_a_blocked_key_at_once():
    async def go(limiter):
        # What revoking a key writes (portal.teams.services); the portal, not the gateway, blocks.
        await limiter.redis.set(limiter.blocked_key("key", KEY.id), "revoked")
        return await limiter.admit(request_id=rid(), team=team(), key=KEY, tokens=1)

    admission = run(go)
    assert (admission.ok, admission.reason) == (False, "key_blocked")


def test_it_puts_a_request_on_the_least_loaded_replica():
    async def go(limiter):
        await limiter.acquire_replica(request_id="x", model="m", candidates=[(1, None), (2, None)])
        placement = await limiter.acquire_replica(
            request_id="y", model="m", candidates=[(1, None), (2, None)]
        )
        return placement.index

    assert run(go) == 1


def test_it_queues_the_excess_over_a_cap_and_admits_it_when_a_slot_frees():
    async def go(limiter):
        cands = [(1, 2)]
        a = await limiter.acquire_replica(request_id="a", model="m", candidates=cands)
        b = await limiter.acquire_replica(request_id="b", model="m", candidates=cands)
        waiting = asyncio.create_task(
            limiter.acquire_replica(request_id="c", model="m", candidates=cands, timeout_s=30)
        )
        await until_queued(limiter, "m", 1)
        await asyncio.sleep(0.1)
        assert not waiting.done()
        await limiter.finish(request_id="a", deployment_id=1)
        c = await waiting
        return a.index, b.index, c.index, c.waited_s

    a, b, c, waited = run(go)
    assert (a, b, c) == (0, 0, 0)
    assert waited >= 0.1


def test_it_times_out_a_queued_request_and_refuses_when_the_queue_is_full():
    async def go(limiter):
        cands = [(1, 1)]
        await limiter.acquire_replica(request_id="a", model="m", candidates=cands)
        # b waits 1 s: less than a's 2 s lease, which would free the slot for it.
        waiting = asyncio.create_task(
            limiter.acquire_replica(request_id="b", model="m", candidates=cands, queue_max=1, timeout_s=1)
        )
        await until_queued(limiter, "m", 1)
        full = await limiter.acquire_replica(
            request_id="c", model="m", candidates=cands, queue_max=1, timeout_s=0.3
        )
        timed_out = await waiting
        queued = await limiter.redis.zcard(limiter.queue_key("m"))
        return full.reason, timed_out.reason, queued

    assert run(go) == ("queue_full", "queue_timeout", 0)


def test_it_leaves_the_queue_when_the_waiting_request_is_cancelled():
    async def go(limiter):
        cands = [(1, 1)]
        await limiter.acquire_replica(request_id="a", model="m", candidates=cands)
        waiting = asyncio.create_task(limiter.acquire_replica(request_id="b", model="m", candidates=cands))
        await until_queued(limiter, "m", 1)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await limiter.finish(request_id="a", deployment_id=1)
        queued = await limiter.redis.zcard(limiter.queue_key("m"))
        return queued, await limiter.redis.zcard(limiter.inflight_key(1))

    assert run(go) == (0, 0)


def test_it_lets_at_most_the_long_prompt_cap_of_long_prompts_in_flight():
    async def go(limiter):
        cands = [(1, None)]
        placements = [
            await limiter.acquire_replica(
                request_id=f"l{i}", model="m", candidates=cands, long_prompt=True, long_cap=2, timeout_s=0.1
            )
            for i in range(3)
        ]
        short = await limiter.acquire_replica(request_id="s", model="m", candidates=cands, timeout_s=0.1)
        return [p.index for p in placements], short.index

    assert run(go) == ([0, 0, None], 0)


def test_it_never_reads_a_cap_of_zero_as_no_cap():
    async def go(limiter):
        closed = await limiter.acquire_replica(request_id="a", model="m", candidates=[(1, 0)], timeout_s=0.1)
        open_ = await limiter.acquire_replica(request_id="b", model="m", candidates=[(2, None)])
        return closed.index, closed.reason, open_.index, await limiter.redis.zcard(limiter.inflight_key(1))

    assert run(go) == (None, "queue_timeout", 0, 0)


def test_it_counts_each_prompt_of_a_batch_against_the_replica_cap():
    async def go(limiter):
        cands = [(1, 4)]
        batch = await limiter.acquire_replica(request_id="a", model="m", candidates=cands, slots=3)
        held = await limiter.redis.zcard(limiter.inflight_key(1))
        two_more = await limiter.acquire_replica(
            request_id="b", model="m", candidates=cands, slots=2, timeout_s=0.1
        )
        one_more = await limiter.acquire_replica(request_id="c", model="m", candidates=cands, timeout_s=0.1)
        await limiter.finish(request_id="a", deployment_id=1, replica_slots=batch.slots)
        left = await limiter.redis.zcard(limiter.inflight_key(1))
        return batch.slots, held, two_more.reason, one_more.index, left

    assert run(go) == (3, 3, "queue_timeout", 0, 1)


def test_it_never_places_more_prompts_than_a_replicas_cap_on_it():
    # Every prompt is a sequence group vLLM runs: 5 prompts on a cap of 2 would run 5 at once.
    async def go(limiter):
        big = await limiter.acquire_replica(
            request_id="a", model="m", candidates=[(1, 2)], slots=5, timeout_s=0.2
        )
        held = await limiter.redis.zcard(limiter.inflight_key(1))
        fits = await limiter.acquire_replica(request_id="b", model="m", candidates=[(1, 2), (2, 8)], slots=5)
        return big.index, big.reason, held, fits.index, fits.slots

    assert run(go) == (None, "queue_timeout", 0, 1, 5)


def test_it_counts_every_prompt_of_a_batch_request_against_the_batch_share():
    # Cap 4, batch share 0.5: batch requests may bring the replica to 2 in flight, prompts included.
    async def go(limiter):
        cands = [(1, 4)]
        four = await limiter.acquire_replica(
            request_id="a", model="m", candidates=cands, slots=4, batch_share=0.5, timeout_s=0.2
        )
        two = await limiter.acquire_replica(
            request_id="b", model="m", candidates=cands, slots=2, batch_share=0.5
        )
        held = await limiter.redis.zcard(limiter.inflight_key(1))
        return four.index, two.index, two.slots, held

    assert run(go) == (None, 0, 2, 2)


def test_it_puts_back_a_lapsed_lease_the_process_still_holds():
    # A renewal round that came too late (or a Redis restart that lost the set): the member is re-added.
    async def go(limiter):
        scope = team(max_concurrent=1)
        first = rid()
        await limiter.admit(request_id=first, team=scope, key=KEY, tokens=1)
        await limiter.redis.zrem(limiter.concurrency_key(scope), first)  # lapsed
        await limiter.renew({limiter.concurrency_key(scope): {first}})
        return (await limiter.admit(request_id=rid(), team=scope, key=KEY, tokens=1)).ok

    assert run(go) is False


def test_it_waits_for_a_renewal_in_flight_before_a_dropped_slot_is_removed():
    async def go(limiter):
        scope = team(max_concurrent=1)
        zset = limiter.concurrency_key(scope)
        keeper = LeaseKeeper(limiter)
        first = rid()
        await limiter.admit(request_id=first, team=scope, key=KEY, tokens=1)
        real, sent = limiter.renew, asyncio.Event()

        async def slow_renew(leases):
            sent.set()
            await asyncio.sleep(0.3)  # the round is on its way while the request finishes
            await real(leases)

        limiter.renew = slow_renew
        keeper.hold([zset], first)
        await sent.wait()
        keeper.drop([zset], first)
        await keeper.settled()
        await limiter.redis.zrem(zset, first)
        return await limiter.redis.zcard(zset)

    assert run(go, lease_ms=300) == 0


def test_it_leaves_a_slot_taken_by_a_poll_whose_reply_was_lost_to_cancellation():
    async def go(limiter):
        cands = [(1, 2)]  # "a" takes one slot, so "b" (two prompts) waits
        await limiter.acquire_replica(request_id="a", model="m", candidates=cands)
        real = limiter._acquire
        polled = asyncio.Event()

        async def placed_then_cancelled(**kwargs):
            result = await real(**kwargs)
            if int(result[0]) > 0:  # the script placed it; the caller is cancelled before it hears so
                raise asyncio.CancelledError
            polled.set()
            return result

        limiter._acquire = placed_then_cancelled
        waiting = asyncio.create_task(
            limiter.acquire_replica(request_id="b", model="m", candidates=cands, slots=2)
        )
        await polled.wait()  # "b" is queued
        await limiter.finish(request_id="a", deployment_id=1)
        with pytest.raises(asyncio.CancelledError):
            await waiting
        in_flight = await limiter.redis.zcard(limiter.inflight_key(1))
        return in_flight, await limiter.redis.zcard(limiter.queue_key("m"))

    assert run(go) == (0, 0)


def test_it_rebuilds_a_missing_daily_counter_from_what_the_database_says_was_used():
    # A Redis restart lost the counter of a 40-token day of which 32 were used and stored.
    asked = []

    async def stored(kind, id, day):
        asked.append((kind, id))
        return 32 if kind == "key" else 0

    async def go(limiter):
        key = Scope("key", 7, Limits(tokens_per_day=40))
        over = await limiter.admit(request_id=rid(), team=team(), key=key, tokens=10)
        fits = await limiter.admit(request_id=rid(), team=team(), key=key, tokens=8)
        return over.reason, fits.ok, int(await limiter.redis.get(limiter.tpd_prefix(key) + str(fits.day)))

    assert run(go, daily_used=stored) == ("key_tpd", True, 40)
    assert asked == [("key", 7)]  # once: the rebuilt counter is used from then on


def test_a_request_admitted_before_its_counter_was_rebuilt_adds_what_it_used():
    # Its reservation died with the old counter: the correction (used - reserved) would undercount.
    async def nothing_stored(kind, id, day):
        return 0

    async def go(limiter):
        scope = team(tokens_per_day=1000)
        admission = await limiter.admit(request_id="a", team=scope, key=KEY, tokens=300)
        counter = limiter.tpd_prefix(scope) + str(admission.day)
        await limiter.redis.delete(counter)  # Redis restarted while "a" streamed
        await limiter.admit(request_id="b", team=scope, key=KEY, tokens=100)  # rebuilt: 0, then 100
        await limiter.finish(request_id="a", team=scope, key=KEY, admission=admission, used_tokens=50)
        return int(await limiter.redis.get(counter))

    assert run(go, daily_used=nothing_stored) == 150


def test_a_request_admitted_right_after_its_counter_was_rebuilt_is_corrected_not_added():
    async def nothing_stored(kind, id, day):
        return 0

    async def go(limiter):
        scope = team(tokens_per_day=1000)
        admission = await limiter.admit(request_id="a", team=scope, key=KEY, tokens=300)  # rebuilt first
        await limiter.finish(request_id="a", team=scope, key=KEY, admission=admission, used_tokens=50)
        return int(await limiter.redis.get(limiter.tpd_prefix(scope) + str(admission.day)))

    assert run(go, daily_used=nothing_stored) == 50


def test_a_failed_lease_renewal_is_logged(caplog):
    """A renewal round that fails (here: nothing listens where Redis should be) is said in the log,
    not swallowed: leases that keep failing lapse, and other processes take the slots."""
    from redis.asyncio import Redis
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff

    from devtools import free_port
    from portal.core.redis.keys import RedisKeys
    from tests.helpers.processes import run_async

    async def go():
        redis = Redis(port=free_port(), socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 0))
        limiter = RateLimiter(redis, keys=RedisKeys(f"test-{rid()[:8]}"), lease_ms=300)
        keeper = LeaseKeeper(limiter)
        keeper.hold([limiter.concurrency_key(team())], rid())
        deadline = asyncio.get_running_loop().time() + 10
        while not [r for r in caplog.records if "lease renewal failed" in r.getMessage()]:
            assert asyncio.get_running_loop().time() < deadline, "no renewal failure logged in 10 s"
            await asyncio.sleep(0.02)
        keeper.leases.clear()  # ends the renewer at its next round
        await redis.aclose()

    with caplog.at_level("WARNING", logger="portal.gateway"):
        run_async(go())
    logged = next(r for r in caplog.records if "lease renewal failed" in r.getMessage())
    assert logged.levelname == "WARNING" and "ConnectionError" in logged.getMessage()
