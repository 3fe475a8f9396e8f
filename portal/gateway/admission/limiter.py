"""Rate limits, token budgets and concurrency slots in Redis, as atomic Lua scripts (their
source, and the layout of each one's keys and arguments, in scripts.py beside this module).

Every web process shares this state, and each check and its increment are one
script, so two processes can never both take the last unit of a quota. Time is
Redis's own clock (`TIME`), never the caller's, so processes with skewed clocks
agree.

- Requests and tokens per minute: GCRA (a "theoretical arrival time" per scope;
  burst = the per-minute limit). A request reserves prompt tokens + its output
  cap at admission; `finish` corrects the reservation to what was really used.
- Tokens per UTC day: a counter per day, reserved and corrected the same way.
- Concurrency: a sorted set of request ids scored by lease expiry. A crashed
  process cannot renew its leases, so its slots come back after one lease;
  `LeaseKeeper` (leases.py) renews the live ones of this process in one batch.
- Per-deployment admission: a cap on in-flight requests per replica, a
  long-prompt cap per replica, least-in-flight choice among replicas, and a
  bounded FIFO queue per model for the excess (`acquire_replica`). A request
  carrying several prompts (vLLM runs one sequence group per prompt) takes that
  many slots, as members `<id>`, `<id>#2`, …, `<id>#k`, and fits only where all
  of them do (`prompt_limit` is the most a request of its class can carry).
- Blocks: a key or team listed under `blocked:*` is refused at once (revocation,
  daily budget spent), checked inside the admission script at no extra cost.
- Priority classes: a batch request sees each replica's cap as its batch share
  (`batch_limit`: ceil(share × cap), so it starts only while in flight < share × cap),
  waits in the model's batch queue, and is placed only while no interactive request
  waits for the model: a freed slot goes to an interactive waiter first, and
  interactive requests never look at the batch queue at all.

Pure Python plus `redis.asyncio`; no Django.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import RedisError

from portal.core.redis.keys import RedisKeys

from .connection import ScriptConnection
from .records import Admission, Scope, SlotGrant, batch_limit, slot_members
from .scripts import (
    ACQUIRE,
    ADMIT,
    ADMIT_PLACE,
    FINISH,
    GIVE_BACK,
    REBUILD_DAY,
    RENEW,
    AcquireCall,
    AdmitCall,
    AdmitPlaceCall,
    CorrectionCall,
    FinishCall,
    GiveBackCall,
    GiveBackScopeCall,
    QuotaCall,
    RebuildDayCall,
    RenewCall,
    ReplicaCall,
)


@dataclass(eq=False)
class _LocalWaiter:
    """A request of this process waiting in a queue, woken early when a slot it could take frees."""

    inflight_keys: frozenset[str]
    batch: bool
    wake: asyncio.Event = field(default_factory=asyncio.Event)


class RateLimiter:
    def __init__(
        self,
        redis: Redis,
        *,
        keys: RedisKeys,
        lease_ms: int = 30_000,
        poll_s: tuple[float, float] = (0.002, 0.05),
        daily_used: Callable[[str, int | str, int], Awaitable[int]] | None = None,
    ) -> None:
        if lease_ms < 1:
            raise ValueError(f"lease_ms={lease_ms}: a lease must last (0 would renew in a busy loop)")
        self.redis = redis
        self.keys = keys
        self.lease_ms = lease_ms
        # (kind, id, UTC day number) -> tokens that scope used that day, from durable storage: a
        # daily counter missing from Redis is rebuilt from it before any admission counts on it.
        self.daily_used = daily_used
        # A queued request polls its queue from poll_s[0] apart, doubling up to poll_s[1]; a slot
        # freed by this process wakes one of its waiters at once (other processes' waiters poll).
        self.poll_s = poll_s
        self._waiters: list[_LocalWaiter] = []
        # Each script is called with its record's `keys()` and `args()` (scripts.py),
        # on one pipelined connection of the client's (connection.py).
        self.scripts = ScriptConnection(redis)
        self._admit = self.scripts.register_script(ADMIT)
        self._acquire = self.scripts.register_script(ACQUIRE)
        self._admit_place = self.scripts.register_script(ADMIT_PLACE)
        self._finish = self.scripts.register_script(FINISH)
        self._renew = self.scripts.register_script(RENEW)
        self._give_back = self.scripts.register_script(GIVE_BACK)
        self._rebuild_day = self.scripts.register_script(REBUILD_DAY)
        self.usage_list = keys.usage

    # --- key names (portal/core/redis/keys.py spells them) --------------------------
    def blocked_key(self, kind: str, id: int | str) -> str:
        return self.keys.blocked(kind, id)

    def concurrency_key(self, scope: Scope) -> str:
        return self.keys.concurrency(scope.kind, scope.id)

    def tpm_key(self, scope: Scope) -> str:
        return self.keys.tpm(scope.kind, scope.id)

    def tpd_prefix(self, scope: Scope) -> str:
        return self.keys.tpd_prefix(scope.kind, scope.id)

    def inflight_key(self, deployment_id: int | str) -> str:
        return self.keys.inflight(deployment_id)

    def long_key(self, deployment_id: int | str) -> str:
        return self.keys.long(deployment_id)

    def open_leases_key(self) -> str:
        """The leases of open usage records (`admit_and_place`'s `open_record`), renewed with the slots."""
        return self.keys.usage_open_leases

    def queue_key(self, model: str, *, batch: bool = False) -> str:
        return self.keys.batch_queue(model) if batch else self.keys.queue(model)

    # --- admission -------------------------------------------------------------
    async def admit(self, *, request_id: str, team: Scope, key: Scope, tokens: int) -> Admission:
        """Check and take, in one step, every team and key quota for one request of `tokens` tokens."""
        call = self._admit_call(request_id, team, key, tokens)
        result = await self._with_daily_counters(
            lambda: self._admit(keys=call.keys(), args=call.args()), team, key
        )
        return self._admission(result, tokens, at_index=3)

    async def _with_daily_counters(self, run: Callable[[], Awaitable[list]], team: Scope, key: Scope) -> list:
        """Run an admission script; while it reports a missing daily counter, rebuild that counter
        from `daily_used` and run it again (a couple of rounds: both scopes may be missing)."""
        for _round in range(3):
            result = await run()
            status = result[0].decode() if isinstance(result[0], bytes) else result[0]
            if not status.endswith("_tpd_unknown"):
                return result
            scope = team if status.startswith("team_") else key
            day = int(result[2])
            assert self.daily_used is not None  # reported missing only when there is one
            used = await self.daily_used(scope.kind, scope.id, day)
            rebuild = RebuildDayCall(
                counter=f"{self.tpd_prefix(scope)}{day}",
                rebuilt_marker=self.keys.tpd_rebuilt(scope.kind, scope.id, day),
                tokens=max(0, int(used)),
            )
            await self._rebuild_day(keys=rebuild.keys(), args=rebuild.args())
        raise RuntimeError("daily counters kept vanishing while being rebuilt")

    async def tokens_used_on_day(self, scope: Scope, day: int) -> int:
        """What `scope`'s daily counter holds for UTC day number `day` (0 when it has none)."""
        return int(await self.redis.get(f"{self.tpd_prefix(scope)}{day}") or 0)

    def _admit_call(self, request_id: str, team: Scope, key: Scope, tokens: int) -> AdmitCall:
        return AdmitCall(
            blocked_team=self.blocked_key("team", team.id),
            blocked_key=self.blocked_key("key", key.id),
            request_id=request_id,
            tokens=tokens,
            lease_ms=self.lease_ms,
            team=self._quota(team),
            api_key=self._quota(key),
            reservation=self.keys.reservation(request_id),
            report_missing_day=1 if self.daily_used is not None else 0,
        )

    def _quota(self, scope: Scope) -> QuotaCall:
        lim = scope.limits
        return QuotaCall(
            rpm_tat=self.keys.rpm(scope.kind, scope.id),
            tpm_tat=self.tpm_key(scope),
            tpd_prefix=self.tpd_prefix(scope),
            concurrency=self.concurrency_key(scope),
            rpm=lim.rpm or 0,
            tpm=lim.tpm or 0,
            tpd=lim.tokens_per_day or 0,
            max_concurrent=lim.max_concurrent or 0,
        )

    @staticmethod
    def _admission(result: list, tokens: int, *, at_index: int) -> Admission:
        status, retry_ms, day = result[:3]
        status = status.decode() if isinstance(status, bytes) else status
        retry = int(retry_ms) / 1000 if int(retry_ms) >= 0 else -1.0
        ok = status == "ok"
        return Admission(
            ok=ok,
            reason="" if ok else status,
            retry_after_s=retry,
            day=int(day),
            tokens=tokens,
            at_us=int(result[at_index]) if ok else 0,
        )

    def _acquire_call(
        self,
        request_id: str,
        model: str,
        candidates,
        long_prompt: bool,
        long_cap: int,
        queue_max: int,
        timeout_s: float,
        slots: int,
        batch_share: float | None,
        interactive_timeout_s: float | None,
    ) -> AcquireCall:
        batch = batch_share is not None
        interactive_timeout_s = timeout_s if interactive_timeout_s is None else interactive_timeout_s
        replicas = []
        for deployment_id, cap in candidates:
            limit = batch_limit(cap, batch_share) if batch_share is not None else cap
            replicas.append(
                ReplicaCall(
                    inflight=self.inflight_key(deployment_id),
                    long=self.long_key(deployment_id),
                    cap=-1 if limit is None else limit,
                )
            )
        return AcquireCall(
            queue=self.queue_key(model, batch=batch),
            interactive_queue=self.queue_key(model),
            request_id=request_id,
            lease_ms=self.lease_ms,
            is_long=1 if long_prompt else 0,
            long_cap=long_cap,
            queue_max=queue_max,
            queue_stale_ms=int(timeout_s * 1000) + self.lease_ms,
            slots=max(1, slots),
            is_batch=1 if batch else 0,
            interactive_queue_stale_ms=int(interactive_timeout_s * 1000) + self.lease_ms,
            candidates=replicas,
        )

    async def acquire_replica(
        self,
        *,
        request_id: str,
        model: str,
        candidates: list[tuple[int | str, int | None]],
        long_prompt: bool = False,
        long_cap: int = 2,
        queue_max: int = 256,
        timeout_s: float = 10.0,
        slots: int = 1,
        batch_share: float | None = None,
        interactive_timeout_s: float | None = None,
    ) -> SlotGrant:
        """Take an in-flight slot on the least-loaded replica that has room, waiting in the model's
        FIFO queue (bounded by `queue_max`) for at most `timeout_s`.

        `candidates` are (deployment id, concurrency cap or None). Cancellation (the client went
        away) leaves the queue at once, so a request cancelled while queued never reaches a replica.
        `slots`: how many prompts the request carries; it takes that many slots on one replica.
        `batch_share` (0 < share ≤ 1) makes it a batch request: it takes a slot only while the
        replica's in-flight count is below share × cap and no interactive request waits for the
        model, and waits in the model's batch queue; `interactive_timeout_s` is the interactive
        queue's deadline (to tell its abandoned entries), when it differs from `timeout_s`.
        """
        call = self._acquire_call(
            request_id, model, candidates, long_prompt, long_cap, queue_max, timeout_s, slots,
            batch_share, interactive_timeout_s,
        )  # fmt: skip
        return await self._wait_for_slot(call, timeout_s, first=None)

    async def admit_and_place(
        self,
        *,
        request_id: str,
        team: Scope,
        key: Scope,
        tokens: int,
        model: str,
        candidates: list[tuple[int | str, int | None]],
        long_prompt: bool = False,
        long_cap: int = 2,
        queue_max: int = 256,
        timeout_s: float = 10.0,
        on_admitted: Callable[[Admission], None] | None = None,
        slots: int = 1,
        batch_share: float | None = None,
        interactive_timeout_s: float | None = None,
        open_record: str = "",
    ) -> tuple[Admission, SlotGrant | None]:
        """`admit`, then `acquire_replica` if admitted, with the first try of both in one script.

        `on_admitted` gets the admission before any wait in the queue: a caller cancelled while
        queued never sees the return value, yet must still release its slots and reservation.
        `open_record` (JSON): the usage record to leave, under a lease, if admitted; `finish` with
        `close_open` forgets it."""
        acquire = self._acquire_call(
            request_id, model, candidates, long_prompt, long_cap, queue_max, timeout_s, slots,
            batch_share, interactive_timeout_s,
        )  # fmt: skip
        call = AdmitPlaceCall(
            admit=self._admit_call(request_id, team, key, tokens),
            usage_open=self.keys.usage_open,
            usage_open_leases=self.keys.usage_open_leases,
            open_record=open_record,
            acquire=acquire,
        )
        result = await self._with_daily_counters(
            lambda: self._admit_place(keys=call.keys(), args=call.args()), team, key
        )
        admission = self._admission(result, tokens, at_index=5)
        if not admission.ok:
            return admission, None
        if on_admitted is not None:
            on_admitted(admission)
        first = (int(result[3]), int(result[4]))
        return admission, await self._wait_for_slot(acquire, timeout_s, first=first)

    async def _wait_for_slot(self, call: AcquireCall, timeout_s: float, *, first: tuple | None) -> SlotGrant:
        loop = asyncio.get_running_loop()
        started = loop.time()
        deadline = started + timeout_s
        delay, longest = self.poll_s
        queued = False
        waiter: _LocalWaiter | None = None  # registered once it waits: most requests never do
        keys: list | None = None  # flattened on the first poll: most requests are placed at once
        try:
            while True:
                if first is not None:
                    (index, _position), first = first, None
                else:
                    if keys is None:
                        keys, args = call.keys(), call.args()
                    index, _position = await self._acquire(keys=keys, args=args)
                index = int(index)
                if index > 0:
                    queued = False
                    return SlotGrant(index - 1, waited_s=loop.time() - started, slots=call.slots)
                if index < 0:
                    return SlotGrant(None, "queue_full", loop.time() - started)
                queued = True
                remaining = deadline - loop.time()
                if remaining <= 0:
                    return SlotGrant(None, "queue_timeout", loop.time() - started)
                if waiter is None:
                    inflight_keys = frozenset(replica.inflight for replica in call.candidates)
                    waiter = _LocalWaiter(inflight_keys=inflight_keys, batch=bool(call.is_batch))
                    self._waiters.append(waiter)
                # A wake-up that came during the poll above is kept: the wait then returns at once.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(min(delay, remaining)):
                        await waiter.wake.wait()
                waiter.wake.clear()
                delay = min(delay * 2, longest)
        except asyncio.CancelledError:
            # A poll cancelled mid-call may have placed the request before its reply was lost: leave
            # any slot it took (nothing else would release it before its lease lapsed).
            await asyncio.shield(self._leave_candidates(call))
            raise
        except RedisError:
            # The same for a poll that timed out: its script may have run (best effort: Redis is ailing).
            with contextlib.suppress(RedisError):
                await asyncio.shield(self._leave_candidates(call))
            raise
        finally:
            if waiter is not None:
                self._waiters.remove(waiter)
            if queued:
                # Shielded so a cancelled request still leaves the queue (its class's).
                await asyncio.shield(self.redis.zrem(call.queue, call.request_id))

    async def _leave_candidates(self, call: AcquireCall) -> None:
        """Leave the in-flight and long-prompt sets of every candidate."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for replica in call.candidates:
                pipe.zrem(replica.inflight, *slot_members(call.request_id, call.slots))
            for replica in call.candidates:
                pipe.zrem(replica.long, call.request_id)
            await pipe.execute()

    async def finish(self, **kwargs: Any) -> None:
        """Leave every slot the request held, correct its tokens, queue its usage record
        (`start_finish`'s keyword arguments), and wait for Redis to have done it."""
        await self.start_finish(**kwargs)

    def start_finish(
        self,
        *,
        request_id: str,
        team: Scope | None = None,
        key: Scope | None = None,
        admission: Admission | None = None,
        used_tokens: int = 0,
        deployment_id: int | str | None = None,
        usage: dict | None = None,
        replica_slots: int = 1,
        close_open: bool = False,
    ) -> Awaitable[None]:
        """Leave every slot the request held (`replica_slots` of them on its replica), correct its
        token reservation to `used_tokens`, queue its usage record and (`close_open`) forget the
        open record its admission left, in one step. The script is written to Redis before this
        returns when the connection is open (anything this process sends later comes after it);
        the awaitable returned is its reply."""
        slots: list[str] = []
        corrections: list[CorrectionCall] = []
        delta = 0
        if admission is not None and admission.ok:
            delta = used_tokens - admission.tokens
            for scope in (team, key):
                if scope is None:
                    continue
                if scope.limits.max_concurrent:
                    slots.append(self.concurrency_key(scope))
                daily = self.tpd_prefix(scope) + str(admission.day) if scope.limits.tokens_per_day else ""
                rebuilt = self.keys.tpd_rebuilt(scope.kind, scope.id, admission.day) if daily else ""
                corrections.append(
                    CorrectionCall(
                        tpm_tat=self.tpm_key(scope),
                        tpd_counter=daily,
                        tpd_rebuilt=rebuilt,
                        tpm=scope.limits.tpm or 0,
                    )
                )
        if deployment_id is not None:
            slots += [self.inflight_key(deployment_id), self.long_key(deployment_id)]
        call = FinishCall(
            usage_list=self.usage_list,
            request_id=request_id,
            usage_json=json.dumps(usage) if usage else "",
            n_slots=len(slots),
            delta_tokens=delta,
            members=replica_slots,
            admitted_us=admission.at_us if admission is not None else 0,
            reserved_tokens=admission.tokens if admission is not None else 0,
            usage_open=self.keys.usage_open,
            usage_open_leases=self.keys.usage_open_leases,
            close_open=1 if close_open else 0,
            slots=slots,
            corrections=corrections,
        )
        return self._finished(self._finish.send_now(call.keys(), call.args()), deployment_id)

    async def _finished(self, reply: Awaitable[object], deployment_id: int | str | None) -> None:
        await reply
        if deployment_id is not None:
            self._wake_one(self.inflight_key(deployment_id))

    def _wake_one(self, inflight_key: str) -> None:
        """Wake this process's longest-waiting request that could take the slot just freed on
        `inflight_key`: an interactive one first, as the placement script would choose."""
        waiting = [w for w in self._waiters if inflight_key in w.inflight_keys and not w.wake.is_set()]
        if waiting:
            min(waiting, key=lambda w: w.batch).wake.set()  # the first of the oldest first

    async def release_replica(self, *, request_id: str, deployment_id: int | str, slots: int = 1) -> None:
        """Leave a replica's slots early (it failed before the first byte; the request moves on)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.zrem(self.inflight_key(deployment_id), *slot_members(request_id, slots))
            pipe.zrem(self.long_key(deployment_id), request_id)
            await pipe.execute()
        self._wake_one(self.inflight_key(deployment_id))

    async def release_long(self, *, request_id: str, deployment_id: int | str) -> None:
        """Leave a replica's long-prompt slot (its prefill is done) and keep the in-flight one."""
        await self.redis.zrem(self.long_key(deployment_id), request_id)

    async def give_back(
        self,
        *,
        request_id: str,
        team: Scope,
        key: Scope,
        model: str,
        candidates: list[tuple[int | str, int | None]],
        slots: int = 1,
    ) -> bool:
        """Undo an admission whose reply was lost (Redis timed out after the script may have run):
        leave its concurrency slots, replica slots and queues, and give back the request and tokens
        it took, exactly once and only if it was admitted. True if it had been admitted."""
        zsets = [self.concurrency_key(s) for s in (team, key)]
        zsets += [self.queue_key(model, batch=True), self.queue_key(model)]
        for deployment_id, _cap in candidates:
            zsets += [self.inflight_key(deployment_id), self.long_key(deployment_id)]
        call = GiveBackCall(
            reservation=self.keys.reservation(request_id),
            request_id=request_id,
            members=max(1, slots),
            n_zsets=len(zsets),
            zsets=zsets,
            scopes=[
                GiveBackScopeCall(
                    rpm_tat=self.keys.rpm(scope.kind, scope.id),
                    tpm_tat=self.tpm_key(scope),
                    tpd_prefix=self.tpd_prefix(scope),
                    rpm=scope.limits.rpm or 0,
                    tpm=scope.limits.tpm or 0,
                    tpd=scope.limits.tokens_per_day or 0,
                )
                for scope in (team, key)
            ],
        )
        return bool(await self._give_back(keys=call.keys(), args=call.args()))

    # --- failed authentication, per client address ---------------------------------
    def auth_failures_key(self, address: str) -> str:
        return self.keys.auth_failures(address)

    async def auth_failures(self, address: str) -> tuple[int, float]:
        """How many authentications failed from `address` in its current window, and the seconds
        left in that window."""
        key = self.auth_failures_key(address)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.get(key)
            pipe.pttl(key)
            count, ttl_ms = await pipe.execute()
        return int(count or 0), max(int(ttl_ms), 0) / 1000

    async def count_auth_failure(self, address: str, *, window_s: float) -> None:
        """One more failed authentication from `address`; its window starts at its first failure."""
        key = self.auth_failures_key(address)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.set(key, 0, px=int(window_s * 1000), nx=True)
            pipe.incr(key)
            await pipe.execute()

    async def renew(self, leases: dict[str, set[str]]) -> None:
        if not leases:
            return
        counted_members: list = []
        for members in leases.values():
            counted_members += [len(members), *members]
        call = RenewCall(lease_ms=self.lease_ms, zsets=list(leases), counted_members=counted_members)
        await self._renew(keys=call.keys(), args=call.args())
