"""Rate limits, token budgets and concurrency slots in Redis, as atomic Lua scripts.

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
  `LeaseKeeper` renews the live ones of this process in one batch.
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
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from redis.asyncio import Redis
from redis.exceptions import RedisError

from .keys import RedisKeys

DAY_MS = 86_400_000

_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
"""

# KEYS: blocked_team, blocked_key, then per scope (team, key): rpm_tat, tpm_tat, tpd_prefix, conc_zset,
#       then the request's reservation record
# ARGV: request_id, tokens, lease_ms, then per scope: rpm, tpm, tpd, conc (0 = no limit),
#       then 1 to report a missing daily counter (`<scope>_tpd_unknown`) instead of taking it as 0
# Returns {status, retry_after_ms, day[, now_us]}; status "ok" (with Redis's time, µs) or the name of
# the limit that said no.
_ADMIT_BODY = """
local day = math.floor(now / 86400000)
if redis.call('EXISTS', KEYS[1]) == 1 then return {'team_blocked', 0, day} end
if redis.call('EXISTS', KEYS[2]) == 1 then return {'key_blocked', 0, day} end
local req, cost, lease = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local commits = {}
for s = 0, 1 do
  local k, a = 2 + s * 4, 3 + s * 4
  local rpm, tpm = tonumber(ARGV[a+1]), tonumber(ARGV[a+2])
  local tpd, conc = tonumber(ARGV[a+3]), tonumber(ARGV[a+4])
  local scope = (s == 0) and 'team_' or 'key_'
  if rpm > 0 then
    local period = 60000 / rpm
    local tat = math.max(tonumber(redis.call('GET', KEYS[k+1]) or 0), now)
    local new_tat = tat + period
    if new_tat - now > 60000 then return {scope .. 'rpm', math.ceil(new_tat - 60000 - now), day} end
    commits[#commits+1] = {KEYS[k+1], new_tat}
  end
  if tpm > 0 and cost > 0 then
    local period = 60000 / tpm
    if cost > tpm then return {scope .. 'tpm_too_large', -1, day} end
    local tat = math.max(tonumber(redis.call('GET', KEYS[k+2]) or 0), now)
    local new_tat = tat + cost * period
    if new_tat - now > 60000 then return {scope .. 'tpm', math.ceil(new_tat - 60000 - now), day} end
    commits[#commits+1] = {KEYS[k+2], new_tat}
  end
  if tpd > 0 then
    local counter = redis.call('GET', KEYS[k+3] .. day)
    -- No counter for today (the day's first request, a limit set today, a Redis restart): the
    -- caller rebuilds it from what the database holds for today, then asks again.
    if not counter and ARGV[12] == '1' then return {scope .. 'tpd_unknown', 0, day} end
    local used = tonumber(counter or 0)
    if cost > tpd then return {scope .. 'tpd_too_large', -1, day} end
    if used + cost > tpd then return {scope .. 'tpd', (day + 1) * 86400000 - now, day} end
  end
  if conc > 0 then
    redis.call('ZREMRANGEBYSCORE', KEYS[k+4], '-inf', now)
    if redis.call('ZCARD', KEYS[k+4]) >= conc then return {scope .. 'concurrency', 1000, day} end
  end
end
for _, c in ipairs(commits) do
  redis.call('SET', c[1], string.format('%.3f', c[2]), 'PX', math.ceil(c[2] - now) + 60000)
end
-- What was taken, for a caller that loses this reply (`GIVE_BACK`); outlives its retries.
redis.call('SET', KEYS[11], day .. ':' .. cost, 'PX', lease + 60000)
for s = 0, 1 do
  local k, a = 2 + s * 4, 3 + s * 4
  if tonumber(ARGV[a+3]) > 0 and cost > 0 then
    redis.call('INCRBY', KEYS[k+3] .. day, cost)
    redis.call('PEXPIRE', KEYS[k+3] .. day, 2 * 86400000)
  end
  if tonumber(ARGV[a+4]) > 0 then
    redis.call('ZADD', KEYS[k+4], now + lease, req)
  end
end
"""
ADMIT = _NOW + _ADMIT_BODY + "return {'ok', 0, day, now_us}"

# KEYS: queue_zset (the request's class's), interactive_queue_zset, then per candidate i:
#       inflight_zset_i, long_zset_i
# ARGV: request_id, lease_ms, is_long, long_cap, queue_max, queue_stale_ms, slots (prompts),
#       is_batch, interactive_queue_stale_ms,
#       then cap_i per candidate (-1 = no cap; 0 = no room, never "unlimited"; a batch request's
#       is its batch limit)
# Returns {index (1-based) or 0 = wait or -1 = queue full, queue position}
# (K0, A0: where its keys and arguments start, so the same code runs alone or after ADMIT.)
_ACQUIRE_FN = """
local function acquire(K0, A0)
  local req, lease, is_long = ARGV[A0+1], tonumber(ARGV[A0+2]), ARGV[A0+3] == '1'
  local long_cap, queue_max, stale = tonumber(ARGV[A0+4]), tonumber(ARGV[A0+5]), tonumber(ARGV[A0+6])
  local need = tonumber(ARGV[A0+7])
  local is_batch = ARGV[A0+8] == '1'
  local queue = KEYS[K0+1]
  redis.call('ZREMRANGEBYSCORE', queue, '-inf', now - stale)
  local rank = redis.call('ZRANK', queue, req)
  local queued = redis.call('ZCARD', queue)
  -- A batch request yields to any interactive request waiting for the model (abandoned entries
  -- of a dead process aside): the freed slot is the interactive one's.
  local yield = false
  if is_batch then
    redis.call('ZREMRANGEBYSCORE', KEYS[K0+2], '-inf', now - tonumber(ARGV[A0+9]))
    yield = redis.call('EXISTS', KEYS[K0+2]) == 1
  end
  local best, best_load, best_take, free_total = 0, math.huge, 0, 0
  local n = (#KEYS - K0 - 2) / 2
  for i = 1, n do
    local inflight, long = KEYS[K0+1+2*i], KEYS[K0+2+2*i]
    redis.call('ZREMRANGEBYSCORE', inflight, '-inf', now)
    local load = redis.call('ZCARD', inflight)
    local cap = tonumber(ARGV[A0+9+i])
    local free = (cap >= 0) and (cap - load) or 1000000
    if free > 0 then free_total = free_total + free end
    -- Every prompt takes a slot: a request with more prompts than a replica's cap (a batch one's:
    -- its batch limit) never fits there (the gateway refuses one that fits nowhere, with a 400).
    local take = need
    local fits = free > 0 and free >= take
    if fits and is_long then
      redis.call('ZREMRANGEBYSCORE', long, '-inf', now)
      fits = redis.call('ZCARD', long) < long_cap
    end
    if fits and load < best_load then best, best_load, best_take = i, load, take end
  end
  -- FIFO: a request may start only when fewer requests wait ahead of it than there are free slots.
  local position = rank or queued
  if best > 0 and position < free_total and not yield then
    redis.call('ZADD', KEYS[K0+1+2*best], now + lease, req)
    for j = 2, best_take do redis.call('ZADD', KEYS[K0+1+2*best], now + lease, req .. '#' .. j) end
    if is_long then redis.call('ZADD', KEYS[K0+2+2*best], now + lease, req) end
    if rank then redis.call('ZREM', queue, req) end
    return best, 0
  end
  if not rank then
    if queued >= queue_max then return -1, queued end
    redis.call('ZADD', queue, now, req)
  end
  return 0, position
end
"""
ACQUIRE = _NOW + _ACQUIRE_FN + "local index, position = acquire(0, 0)\nreturn {index, position}"
# ADMIT then, if admitted, ACQUIRE: one round trip for the common case (admitted, a slot free).
ADMIT_PLACE = (
    _NOW
    + _ACQUIRE_FN
    + _ADMIT_BODY
    + "local index, position = acquire(11, 12)\nreturn {'ok', 0, day, index, position, now_us}"
)

# KEYS: usage_list, then slot zsets to leave, then triples (tpm_tat, tpd_key, tpd_rebuilt) to correct
# ARGV: request_id, usage_json, n_slots, delta_tokens, members (1 + extra replica slots `<id>#j`),
#       admitted_us, reserved_tokens, then per triple: tokens-per-minute limit (0 = skip)
# A daily counter rebuilt from the database after this request was admitted never held its
# reservation (a Redis restart lost it; the record is not in the database yet): it gets the tokens
# used, not the correction.
FINISH = (
    _NOW
    + """
local req, n_slots, delta, members = ARGV[1], tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local admitted, reserved = tonumber(ARGV[6]), tonumber(ARGV[7])
for i = 2, 1 + n_slots do
  redis.call('ZREM', KEYS[i], req)
  for j = 2, members do redis.call('ZREM', KEYS[i], req .. '#' .. j) end
end
local p = 8
for i = 2 + n_slots, #KEYS, 3 do
  local tpm = tonumber(ARGV[p]); p = p + 1
  if tpm > 0 and delta ~= 0 then
    local tat = redis.call('GET', KEYS[i])
    if tat then
      -- An over-use moves the clock past what admission's TTL covers: stretch the TTL with it,
      -- or the key (and the debt) would vanish before the clock is reached.
      local new_tat = tonumber(tat) + delta * 60000 / tpm
      local ttl = math.ceil(new_tat - now) + 60000
      if ttl > 0 and ttl > redis.call('PTTL', KEYS[i]) then
        redis.call('SET', KEYS[i], string.format('%.3f', new_tat), 'PX', ttl)
      else
        redis.call('SET', KEYS[i], string.format('%.3f', new_tat), 'KEEPTTL')
      end
    end
  end
  if KEYS[i+1] ~= '' and redis.call('EXISTS', KEYS[i+1]) == 1 then
    local add = delta
    local rebuilt = redis.call('GET', KEYS[i+2])
    if rebuilt and tonumber(rebuilt) > admitted then add = delta + reserved end
    if add ~= 0 then redis.call('INCRBY', KEYS[i+1], add) end
  end
end
if ARGV[2] ~= '' then redis.call('RPUSH', KEYS[1], ARGV[2]) end
return 1
"""
)

# A missing daily counter, rebuilt from the database: set only if still missing (another process
# may have rebuilt it meanwhile), with the time of the rebuild, which `FINISH` reads.
# KEYS: counter, rebuilt_marker; ARGV: tokens used today
REBUILD_DAY = (
    _NOW
    + """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', 2 * 86400000) then
  redis.call('SET', KEYS[2], string.format('%.0f', now_us), 'PX', 2 * 86400000)
  return 1
end
return 0
"""
)

# An admission whose reply was lost (a Redis timeout): leave every slot and queue it may hold and,
# only if its reservation record says it was admitted, give back its request and tokens, once.
# KEYS: reservation, then zsets to leave, then per scope (rpm_tat, tpm_tat, tpd_prefix)
# ARGV: request_id, members (slots per replica), n_zsets, then per scope: rpm, tpm, tpd (0 = none)
GIVE_BACK = """
local req, members, n = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
for i = 2, 1 + n do
  redis.call('ZREM', KEYS[i], req)
  for j = 2, members do redis.call('ZREM', KEYS[i], req .. '#' .. j) end
end
local taken = redis.call('GET', KEYS[1])
if not taken then return 0 end
redis.call('DEL', KEYS[1])
local sep = string.find(taken, ':', 1, true)
local day, cost = string.sub(taken, 1, sep - 1), tonumber(string.sub(taken, sep + 1))
local p = 4
for k = 2 + n, #KEYS, 3 do
  local rpm, tpm, tpd = tonumber(ARGV[p]), tonumber(ARGV[p+1]), tonumber(ARGV[p+2]); p = p + 3
  local back = {}
  if rpm > 0 then back[#back+1] = {KEYS[k], 60000 / rpm} end
  if tpm > 0 and cost > 0 then back[#back+1] = {KEYS[k+1], cost * 60000 / tpm} end
  for _, b in ipairs(back) do
    local tat = redis.call('GET', b[1])
    if tat then redis.call('SET', b[1], string.format('%.3f', tonumber(tat) - b[2]), 'KEEPTTL') end
  end
  if tpd > 0 and cost > 0 and redis.call('EXISTS', KEYS[k+2] .. day) == 1 then
    redis.call('DECRBY', KEYS[k+2] .. day, cost)
  end
end
return 1
"""

# KEYS: zsets; ARGV: lease_ms, then for each zset the number of members that follow, then members.
# A plain ZADD, not `XX`: a member this process still holds is put back if it lapsed (a renewal
# round that failed, a Redis restart that lost the sets); the caller stops renewing a member, and
# waits for a round in flight (`LeaseKeeper.settled`), before removing it.
RENEW = (
    _NOW
    + """
local lease = tonumber(ARGV[1])
local p = 2
for i = 1, #KEYS do
  local count = tonumber(ARGV[p]); p = p + 1
  for j = 1, count do
    redis.call('ZADD', KEYS[i], now + lease, ARGV[p]); p = p + 1
  end
end
return 1
"""
)


@dataclass(frozen=True)
class Limits:
    """The quotas of one scope (a team or a key); None = no limit."""

    rpm: int | None = None
    tpm: int | None = None
    tokens_per_day: int | None = None
    max_concurrent: int | None = None


@dataclass(frozen=True)
class Scope:
    kind: str  # "team" or "key"
    id: int | str
    limits: Limits = field(default_factory=Limits)


@dataclass
class Admission:
    ok: bool
    reason: str = ""
    retry_after_s: float = 0.0  # negative: retrying cannot help (the request alone exceeds the quota)
    day: int = 0
    tokens: int = 0
    at_us: int = 0  # Redis's time when it was admitted (µs: a rebuild of its daily counter is ordered by it)


@dataclass
class SlotGrant:
    """Where a request was admitted (index into the candidates) or why not."""

    index: int | None
    reason: str = ""  # "queue_full" | "queue_timeout" when index is None
    waited_s: float = 0.0
    slots: int = 1  # replica slots taken: one per prompt


def batch_limit(cap: int | None, share: float) -> int | None:
    """The in-flight count a batch request may bring a replica to: it may start only while in
    flight < share × cap, i.e. in flight < ceil(share × cap) (None: no cap, no limit).

    Computed here rather than in Lua so a share like 0.3 × 10 (3.0000000000000004 in floating
    point) gives 3, not 4."""
    if cap is None:
        return None
    return math.ceil(round(cap * share, 9))


def prompt_limit(caps: list[int | None], share: float | None) -> int | None:
    """The most prompts one request may carry on these replicas: every prompt takes a slot, so
    the largest cap (a batch request's: its batch limit); None when some replica has no cap."""
    limits = [cap if share is None else batch_limit(cap, share) for cap in caps]
    if not limits or any(limit is None for limit in limits):
        return None
    return max(limits)


def slot_members(request_id: str, slots: int) -> list[str]:
    """The members a request holds in a replica's in-flight set: one per slot."""
    return [request_id, *(f"{request_id}#{j}" for j in range(2, slots + 1))]


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
        self._admit = redis.register_script(ADMIT)
        self._acquire = redis.register_script(ACQUIRE)
        self._admit_place = redis.register_script(ADMIT_PLACE)
        self._finish = redis.register_script(FINISH)
        self._renew = redis.register_script(RENEW)
        self._give_back = redis.register_script(GIVE_BACK)
        self._rebuild_day = redis.register_script(REBUILD_DAY)
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

    def queue_key(self, model: str, *, batch: bool = False) -> str:
        return self.keys.batch_queue(model) if batch else self.keys.queue(model)

    # --- admission -------------------------------------------------------------
    async def admit(self, *, request_id: str, team: Scope, key: Scope, tokens: int) -> Admission:
        """Check and take, in one step, every team and key quota for one request of `tokens` tokens."""
        keys, args = self._admit_keys_args(request_id, team, key, tokens)
        result = await self._with_daily_counters(lambda: self._admit(keys=keys, args=args), team, key)
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
            used = await self.daily_used(scope.kind, scope.id, day)
            counter, rebuilt = (
                f"{self.tpd_prefix(scope)}{day}",
                self.keys.tpd_rebuilt(scope.kind, scope.id, day),
            )
            await self._rebuild_day(keys=[counter, rebuilt], args=[max(0, int(used))])
        raise RuntimeError("daily counters kept vanishing while being rebuilt")

    def _admit_keys_args(self, request_id: str, team: Scope, key: Scope, tokens: int) -> tuple[list, list]:
        keys = [self.blocked_key("team", team.id), self.blocked_key("key", key.id)]
        args: list = [request_id, tokens, self.lease_ms]
        for scope in (team, key):
            keys += [
                self.keys.rpm(scope.kind, scope.id),
                self.tpm_key(scope),
                self.tpd_prefix(scope),
                self.concurrency_key(scope),
            ]
            lim = scope.limits
            args += [lim.rpm or 0, lim.tpm or 0, lim.tokens_per_day or 0, lim.max_concurrent or 0]
        keys.append(self.keys.reservation(request_id))
        args.append(1 if self.daily_used is not None else 0)
        return keys, args

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

    def _acquire_keys_args(
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
    ) -> tuple[list, list]:
        batch = batch_share is not None
        keys = [self.queue_key(model, batch=batch), self.queue_key(model)]
        for deployment_id, _cap in candidates:
            keys += [self.inflight_key(deployment_id), self.long_key(deployment_id)]
        caps = [batch_limit(cap, batch_share) if batch else cap for _id, cap in candidates]
        interactive_timeout_s = timeout_s if interactive_timeout_s is None else interactive_timeout_s
        args = [
            request_id,
            self.lease_ms,
            1 if long_prompt else 0,
            long_cap,
            queue_max,
            int(timeout_s * 1000) + self.lease_ms,  # a queued entry older than this was abandoned
            max(1, slots),
            1 if batch else 0,
            int(interactive_timeout_s * 1000) + self.lease_ms,  # the same, for the interactive queue
            *[-1 if cap is None else cap for cap in caps],
        ]
        return keys, args

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
        keys, args = self._acquire_keys_args(
            request_id, model, candidates, long_prompt, long_cap, queue_max, timeout_s, slots,
            batch_share, interactive_timeout_s,
        )  # fmt: skip
        return await self._wait_for_slot(keys, args, request_id, timeout_s, first=None)

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
    ) -> tuple[Admission, SlotGrant | None]:
        """`admit`, then `acquire_replica` if admitted, with the first try of both in one script.

        `on_admitted` gets the admission before any wait in the queue: a caller cancelled while
        queued never sees the return value, yet must still release its slots and reservation."""
        admit_keys, admit_args = self._admit_keys_args(request_id, team, key, tokens)
        keys, args = self._acquire_keys_args(
            request_id, model, candidates, long_prompt, long_cap, queue_max, timeout_s, slots,
            batch_share, interactive_timeout_s,
        )  # fmt: skip
        result = await self._with_daily_counters(
            lambda: self._admit_place(keys=admit_keys + keys, args=admit_args + args), team, key
        )
        admission = self._admission(result, tokens, at_index=5)
        if not admission.ok:
            return admission, None
        if on_admitted is not None:
            on_admitted(admission)
        first = (int(result[3]), int(result[4]))
        return admission, await self._wait_for_slot(keys, args, request_id, timeout_s, first=first)

    async def _wait_for_slot(
        self, keys: list, args: list, request_id: str, timeout_s: float, *, first: tuple | None
    ) -> SlotGrant:
        loop = asyncio.get_running_loop()
        started = loop.time()
        deadline = started + timeout_s
        delay, longest = self.poll_s
        queued = False
        waiter: _LocalWaiter | None = None  # registered once it waits: most requests never do
        try:
            while True:
                if first is not None:
                    (index, _position), first = first, None
                else:
                    index, _position = await self._acquire(keys=keys, args=args)
                index = int(index)
                if index > 0:
                    queued = False
                    return SlotGrant(index - 1, waited_s=loop.time() - started, slots=args[6])
                if index < 0:
                    return SlotGrant(None, "queue_full", loop.time() - started)
                queued = True
                remaining = deadline - loop.time()
                if remaining <= 0:
                    return SlotGrant(None, "queue_timeout", loop.time() - started)
                if waiter is None:
                    waiter = _LocalWaiter(inflight_keys=frozenset(keys[2::2]), batch=keys[0] != keys[1])
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
            await asyncio.shield(self._leave_candidates(keys, request_id, int(args[6])))
            raise
        except RedisError:
            # The same for a poll that timed out: its script may have run (best effort: Redis is ailing).
            with contextlib.suppress(RedisError):
                await asyncio.shield(self._leave_candidates(keys, request_id, int(args[6])))
            raise
        finally:
            if waiter is not None:
                self._waiters.remove(waiter)
            if queued:
                # Shielded so a cancelled request still leaves the queue (its class's: keys[0]).
                await asyncio.shield(self.redis.zrem(keys[0], request_id))

    async def _leave_candidates(self, keys: list, request_id: str, slots: int) -> None:
        """Leave the in-flight and long-prompt sets of every candidate (keys as `_acquire_keys_args`)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for inflight in keys[2::2]:
                pipe.zrem(inflight, *slot_members(request_id, slots))
            for long in keys[3::2]:
                pipe.zrem(long, request_id)
            await pipe.execute()

    async def finish(
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
    ) -> None:
        """Leave every slot the request held (`replica_slots` of them on its replica), correct its
        token reservation to `used_tokens`, and queue its usage record, in one step."""
        slots: list[str] = []
        pairs: list[str] = []
        tpms: list[int] = []
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
                pairs += [self.tpm_key(scope), daily, rebuilt]
                tpms.append(scope.limits.tpm or 0)
        if deployment_id is not None:
            slots += [self.inflight_key(deployment_id), self.long_key(deployment_id)]
        await self._finish(
            keys=[self.usage_list, *slots, *pairs],
            args=[
                request_id,
                json.dumps(usage) if usage else "",
                len(slots),
                delta,
                replica_slots,
                admission.at_us if admission is not None else 0,
                admission.tokens if admission is not None else 0,
                *tpms,
            ],
        )
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
        keys, args = [self.keys.reservation(request_id), *zsets], [request_id, max(1, slots), len(zsets)]
        for scope in (team, key):
            keys += [self.keys.rpm(scope.kind, scope.id), self.tpm_key(scope), self.tpd_prefix(scope)]
            lim = scope.limits
            args += [lim.rpm or 0, lim.tpm or 0, lim.tokens_per_day or 0]
        return bool(await self._give_back(keys=keys, args=args))

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
        keys, args = [], [self.lease_ms]
        for zset, members in leases.items():
            keys.append(zset)
            args += [len(members), *members]
        await self._renew(keys=keys, args=args)


class LeaseKeeper:
    """Renews the concurrency leases of this process's live requests, in one batch every
    lease/3, so a long stream keeps its slot and a crashed process's slots expire.

    A renewal puts back a member that lapsed (a failed round, a Redis restart): whatever this
    process still holds is in its sets again within one round. So a member is removed from Redis
    only after `drop` and `settled` (no round in flight could put it back)."""

    def __init__(self, limiter: RateLimiter) -> None:
        self.limiter = limiter
        self.leases: dict[str, set[str]] = {}
        self._task: asyncio.Task | None = None
        self._round: asyncio.Task | None = None

    def hold(self, zsets: list[str], member: str) -> None:
        for zset in zsets:
            self.leases.setdefault(zset, set()).add(member)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    def drop(self, zsets: list[str], member: str) -> None:
        for zset in zsets:
            members = self.leases.get(zset)
            if members is not None:
                members.discard(member)
                if not members:
                    del self.leases[zset]

    async def settled(self) -> None:
        """Until no renewal round is in flight: one sent before a `drop` could re-add the member."""
        current = self._round
        if current is not None and not current.done():
            await asyncio.wait([current])

    async def _run(self) -> None:
        interval = self.limiter.lease_ms / 3000
        delay = interval
        while self.leases:
            await asyncio.sleep(delay)
            if not self.leases:
                break
            held = {zset: set(members) for zset, members in self.leases.items()}
            self._round = asyncio.ensure_future(self.limiter.renew(held))
            try:
                await self._round
                delay = interval
            except Exception:
                # A Redis blip: retry sooner than a whole interval, so no lease lapses for it.
                delay = interval / 4
            finally:
                self._round = None
