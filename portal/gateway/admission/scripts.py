"""The gateway's Lua scripts: admission (quotas, blocks), replica slots and queues, lease renewal,
and the finish that leaves the slots, corrects the reservation and queues the usage record.

Each has its call record (the layout of its KEYS and ARGV, by name); the mechanism (`ScriptCall`,
the positions, Redis's clock) is portal/core/redis/scripts.py. Called by `RateLimiter`
(limiter.py) on the pipelined connection (connection.py).

Pure Python; no Django.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from portal.core.redis.scripts import ARG, ARG_LIST, KEY, KEY_LIST, ScriptCall, build_script, group


@dataclass(frozen=True)
class QuotaCall(ScriptCall):
    """One scope's (a team's or a key's) quota keys and limits, within an admission."""

    LUA_PREFIX = "QUOTA"
    rpm_tat: str = field(metadata=KEY)
    tpm_tat: str = field(metadata=KEY)
    tpd_prefix: str = field(metadata=KEY)  # followed by the UTC day number
    concurrency: str = field(metadata=KEY)
    rpm: int = field(metadata=ARG)  # 0 = no limit, as for every limit here
    tpm: int = field(metadata=ARG)
    tpd: int = field(metadata=ARG)
    max_concurrent: int = field(metadata=ARG)


@dataclass(frozen=True)
class AdmitCall(ScriptCall):
    LUA_PREFIX = "ADMIT"
    blocked_team: str = field(metadata=KEY)
    blocked_key: str = field(metadata=KEY)
    request_id: str = field(metadata=ARG)
    tokens: int = field(metadata=ARG)
    lease_ms: int = field(metadata=ARG)
    # The key's quotas follow the team's: the script loops over both.
    team: QuotaCall = field(metadata=group(QuotaCall))
    api_key: QuotaCall = field(metadata=group(QuotaCall))
    reservation: str = field(metadata=KEY)  # what was taken, for a caller that loses the reply
    # 1: report a missing daily counter (`<scope>_tpd_unknown`) instead of taking it as 0.
    report_missing_day: int = field(metadata=ARG)


@dataclass(frozen=True)
class ReplicaCall(ScriptCall):
    """One candidate replica, within a placement."""

    LUA_PREFIX = "REPLICA"
    inflight: str = field(metadata=KEY)
    long: str = field(metadata=KEY)
    # -1 = no cap; 0 = no room, never "unlimited"; a batch request's is its batch limit.
    cap: int = field(metadata=ARG)


@dataclass(frozen=True)
class AcquireCall(ScriptCall):
    LUA_PREFIX = "ACQUIRE"
    queue: str = field(metadata=KEY)  # the request's class's queue
    interactive_queue: str = field(metadata=KEY)
    request_id: str = field(metadata=ARG)
    lease_ms: int = field(metadata=ARG)
    is_long: int = field(metadata=ARG)
    long_cap: int = field(metadata=ARG)
    queue_max: int = field(metadata=ARG)
    queue_stale_ms: int = field(metadata=ARG)  # a queued entry older than this was abandoned
    slots: int = field(metadata=ARG)  # prompts: one replica slot each
    is_batch: int = field(metadata=ARG)
    interactive_queue_stale_ms: int = field(metadata=ARG)
    candidates: list[ReplicaCall] = field(metadata=group(ReplicaCall, many=True))


@dataclass(frozen=True)
class AdmitPlaceCall(ScriptCall):
    LUA_PREFIX = "ADMIT_PLACE"
    admit: AdmitCall = field(metadata=group(AdmitCall))
    # The record the request leaves if its gateway process dies before `FINISH` (an `interrupted`
    # one billing the reservation), written with the reservation itself: no round trip of its own.
    usage_open: str = field(metadata=KEY)
    usage_open_leases: str = field(metadata=KEY)
    open_record: str = field(metadata=ARG)  # '' = none
    acquire: AcquireCall = field(metadata=group(AcquireCall))


@dataclass(frozen=True)
class CorrectionCall(ScriptCall):
    """One scope's counters that `FINISH` corrects to the tokens really used."""

    LUA_PREFIX = "CORRECTION"
    tpm_tat: str = field(metadata=KEY)
    tpd_counter: str = field(metadata=KEY)  # '' = no daily limit
    tpd_rebuilt: str = field(metadata=KEY)
    tpm: int = field(metadata=ARG)  # 0 = skip the per-minute correction


@dataclass(frozen=True)
class FinishCall(ScriptCall):
    LUA_PREFIX = "FINISH"
    usage_list: str = field(metadata=KEY)
    request_id: str = field(metadata=ARG)
    usage_json: str = field(metadata=ARG)  # '' = no record
    n_slots: int = field(metadata=ARG)
    delta_tokens: int = field(metadata=ARG)
    members: int = field(metadata=ARG)  # 1 + extra replica slots `<id>#j`
    admitted_us: int = field(metadata=ARG)
    reserved_tokens: int = field(metadata=ARG)
    usage_open: str = field(metadata=KEY)  # the open record `ADMIT_PLACE` left, forgotten here
    usage_open_leases: str = field(metadata=KEY)
    close_open: int = field(metadata=ARG)  # 1: the request may have left an open record
    slots: list[str] = field(metadata=KEY_LIST)  # sorted sets to leave
    corrections: list[CorrectionCall] = field(metadata=group(CorrectionCall, many=True))


@dataclass(frozen=True)
class RebuildDayCall(ScriptCall):
    LUA_PREFIX = "REBUILD"
    counter: str = field(metadata=KEY)
    rebuilt_marker: str = field(metadata=KEY)
    tokens: int = field(metadata=ARG)  # used that day, from the database


@dataclass(frozen=True)
class GiveBackScopeCall(ScriptCall):
    LUA_PREFIX = "RETURN"
    rpm_tat: str = field(metadata=KEY)
    tpm_tat: str = field(metadata=KEY)
    tpd_prefix: str = field(metadata=KEY)
    rpm: int = field(metadata=ARG)  # 0 = none
    tpm: int = field(metadata=ARG)
    tpd: int = field(metadata=ARG)


@dataclass(frozen=True)
class GiveBackCall(ScriptCall):
    LUA_PREFIX = "GIVE_BACK"
    reservation: str = field(metadata=KEY)
    request_id: str = field(metadata=ARG)
    members: int = field(metadata=ARG)  # slots per replica
    n_zsets: int = field(metadata=ARG)
    zsets: list[str] = field(metadata=KEY_LIST)  # every slot and queue the admission may hold
    scopes: list[GiveBackScopeCall] = field(metadata=group(GiveBackScopeCall, many=True))


@dataclass(frozen=True)
class RenewCall(ScriptCall):
    LUA_PREFIX = "RENEW"
    lease_ms: int = field(metadata=ARG)
    zsets: list[str] = field(metadata=KEY_LIST)
    counted_members: list[Any] = field(metadata=ARG_LIST)  # per zset: how many members, then the members


_ADMIT_BODY = """
local day = math.floor(now / 86400000)
if redis.call('EXISTS', KEYS[ADMIT_K_BLOCKED_TEAM]) == 1 then return {'team_blocked', 0, day} end
if redis.call('EXISTS', KEYS[ADMIT_K_BLOCKED_KEY]) == 1 then return {'key_blocked', 0, day} end
local req, cost = ARGV[ADMIT_A_REQUEST_ID], tonumber(ARGV[ADMIT_A_TOKENS])
local lease = tonumber(ARGV[ADMIT_A_LEASE_MS])
local commits = {}
for s = 0, 1 do
  local k, a = ADMIT_K_TEAM - 1 + s * QUOTA_K_WIDTH, ADMIT_A_TEAM - 1 + s * QUOTA_A_WIDTH
  local rpm, tpm = tonumber(ARGV[a+QUOTA_A_RPM]), tonumber(ARGV[a+QUOTA_A_TPM])
  local tpd, conc = tonumber(ARGV[a+QUOTA_A_TPD]), tonumber(ARGV[a+QUOTA_A_MAX_CONCURRENT])
  local scope = (s == 0) and 'team_' or 'key_'
  if rpm > 0 then
    local period = 60000 / rpm
    local tat = math.max(tonumber(redis.call('GET', KEYS[k+QUOTA_K_RPM_TAT]) or 0), now)
    local new_tat = tat + period
    if new_tat - now > 60000 then return {scope .. 'rpm', math.ceil(new_tat - 60000 - now), day} end
    commits[#commits+1] = {KEYS[k+QUOTA_K_RPM_TAT], new_tat}
  end
  if tpm > 0 and cost > 0 then
    local period = 60000 / tpm
    if cost > tpm then return {scope .. 'tpm_too_large', -1, day} end
    local tat = math.max(tonumber(redis.call('GET', KEYS[k+QUOTA_K_TPM_TAT]) or 0), now)
    local new_tat = tat + cost * period
    if new_tat - now > 60000 then return {scope .. 'tpm', math.ceil(new_tat - 60000 - now), day} end
    commits[#commits+1] = {KEYS[k+QUOTA_K_TPM_TAT], new_tat}
  end
  if tpd > 0 then
    local counter = redis.call('GET', KEYS[k+QUOTA_K_TPD_PREFIX] .. day)
    -- No counter for today (the day's first request, a limit set today, a Redis restart): the
    -- caller rebuilds it from what the database holds for today, then asks again.
    if not counter and ARGV[ADMIT_A_REPORT_MISSING_DAY] == '1' then
      return {scope .. 'tpd_unknown', 0, day}
    end
    local used = tonumber(counter or 0)
    if cost > tpd then return {scope .. 'tpd_too_large', -1, day} end
    if used + cost > tpd then return {scope .. 'tpd', (day + 1) * 86400000 - now, day} end
  end
  if conc > 0 then
    redis.call('ZREMRANGEBYSCORE', KEYS[k+QUOTA_K_CONCURRENCY], '-inf', now)
    if redis.call('ZCARD', KEYS[k+QUOTA_K_CONCURRENCY]) >= conc then
      return {scope .. 'concurrency', 1000, day}
    end
  end
end
for _, c in ipairs(commits) do
  redis.call('SET', c[1], string.format('%.3f', c[2]), 'PX', math.ceil(c[2] - now) + 60000)
end
-- What was taken, for a caller that loses this reply (`GIVE_BACK`); outlives its retries.
redis.call('SET', KEYS[ADMIT_K_RESERVATION], day .. ':' .. cost, 'PX', lease + 60000)
for s = 0, 1 do
  local k, a = ADMIT_K_TEAM - 1 + s * QUOTA_K_WIDTH, ADMIT_A_TEAM - 1 + s * QUOTA_A_WIDTH
  local tpd_prefix = KEYS[k+QUOTA_K_TPD_PREFIX]
  if tonumber(ARGV[a+QUOTA_A_TPD]) > 0 and cost > 0 then
    redis.call('INCRBY', tpd_prefix .. day, cost)
    redis.call('PEXPIRE', tpd_prefix .. day, 2 * 86400000)
  end
  if tonumber(ARGV[a+QUOTA_A_MAX_CONCURRENT]) > 0 then
    redis.call('ZADD', KEYS[k+QUOTA_K_CONCURRENCY], now + lease, req)
  end
end
"""

# Check and take, in one step, every team and key quota for one request (`AdmitCall`).
# Returns {status, retry_after_ms, day[, now_us]}; status "ok" (with Redis's time, µs) or the name of
# the limit that said no.
ADMIT = build_script(QuotaCall, AdmitCall, body=_ADMIT_BODY + "return {'ok', 0, day, now_us}")

# Place a request on the least-loaded candidate replica with room, or queue it (`AcquireCall`).
# Returns {index (1-based) or 0 = wait or -1 = queue full, queue position}.
# (K0, A0: how many keys and arguments come before its own, so the same code runs alone or after ADMIT.)
_ACQUIRE_FN = """
local function acquire(K0, A0)
  local req, lease = ARGV[A0+ACQUIRE_A_REQUEST_ID], tonumber(ARGV[A0+ACQUIRE_A_LEASE_MS])
  local is_long = ARGV[A0+ACQUIRE_A_IS_LONG] == '1'
  local long_cap, queue_max = tonumber(ARGV[A0+ACQUIRE_A_LONG_CAP]), tonumber(ARGV[A0+ACQUIRE_A_QUEUE_MAX])
  local stale = tonumber(ARGV[A0+ACQUIRE_A_QUEUE_STALE_MS])
  local need = tonumber(ARGV[A0+ACQUIRE_A_SLOTS])
  local is_batch = ARGV[A0+ACQUIRE_A_IS_BATCH] == '1'
  local queue, interactive_queue = KEYS[K0+ACQUIRE_K_QUEUE], KEYS[K0+ACQUIRE_K_INTERACTIVE_QUEUE]
  redis.call('ZREMRANGEBYSCORE', queue, '-inf', now - stale)
  local rank = redis.call('ZRANK', queue, req)
  local queued = redis.call('ZCARD', queue)
  -- A batch request yields to any interactive request waiting for the model (abandoned entries
  -- of a dead process aside): the freed slot is the interactive one's.
  local yield = false
  if is_batch then
    local interactive_stale = tonumber(ARGV[A0+ACQUIRE_A_INTERACTIVE_QUEUE_STALE_MS])
    redis.call('ZREMRANGEBYSCORE', interactive_queue, '-inf', now - interactive_stale)
    yield = redis.call('EXISTS', interactive_queue) == 1
  end
  local best, best_load, best_take, free_total = 0, math.huge, 0, 0
  local best_inflight, best_long
  local n = (#KEYS - K0 - ACQUIRE_K_CANDIDATES + 1) / REPLICA_K_WIDTH
  for i = 1, n do
    local k = K0 + ACQUIRE_K_CANDIDATES - 1 + (i - 1) * REPLICA_K_WIDTH
    local a = A0 + ACQUIRE_A_CANDIDATES - 1 + (i - 1) * REPLICA_A_WIDTH
    local inflight, long = KEYS[k+REPLICA_K_INFLIGHT], KEYS[k+REPLICA_K_LONG]
    redis.call('ZREMRANGEBYSCORE', inflight, '-inf', now)
    local load = redis.call('ZCARD', inflight)
    local cap = tonumber(ARGV[a+REPLICA_A_CAP])
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
    if fits and load < best_load then
      best, best_load, best_take, best_inflight, best_long = i, load, take, inflight, long
    end
  end
  -- FIFO: a request may start only when fewer requests wait ahead of it than there are free slots.
  local position = rank or queued
  if best > 0 and position < free_total and not yield then
    redis.call('ZADD', best_inflight, now + lease, req)
    for j = 2, best_take do redis.call('ZADD', best_inflight, now + lease, req .. '#' .. j) end
    if is_long then redis.call('ZADD', best_long, now + lease, req) end
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
ACQUIRE = build_script(
    ReplicaCall,
    AcquireCall,
    body=_ACQUIRE_FN + "local index, position = acquire(0, 0)\nreturn {index, position}",
)

# An admitted request's open record, under a lease by Redis's clock (renewed with the request's slots,
# `LeaseKeeper`), until `FINISH` removes it; the usage flush queues it once its lease lapsed
# (portal/teams/services/usage_queue.py, on a script of portal/core/redis/scripts.py).
_OPEN_BODY = """
if ARGV[ADMIT_PLACE_A_OPEN_RECORD] ~= '' then
  redis.call('HSET', KEYS[ADMIT_PLACE_K_USAGE_OPEN], req, ARGV[ADMIT_PLACE_A_OPEN_RECORD])
  redis.call('ZADD', KEYS[ADMIT_PLACE_K_USAGE_OPEN_LEASES], now + lease, req)
end
"""

# ADMIT then, if admitted, the open record and ACQUIRE: one round trip for the common case
# (admitted, a slot free).
# Returns {status, retry_after_ms, day, index, position, now_us}.
ADMIT_PLACE = build_script(
    QuotaCall,
    AdmitCall,
    ReplicaCall,
    AcquireCall,
    AdmitPlaceCall,
    body=_ACQUIRE_FN
    + _ADMIT_BODY
    + _OPEN_BODY
    + "local index, position = acquire(ADMIT_PLACE_K_ACQUIRE - 1, ADMIT_PLACE_A_ACQUIRE - 1)\n"
    + "return {'ok', 0, day, index, position, now_us}",
)

# Leave every slot a request held, correct its reservation to the tokens used, queue its usage
# record and forget its open one (`FinishCall`). A daily counter rebuilt from the database after
# this request was admitted never held its reservation (a Redis restart lost it; the record is
# not in the database yet): it gets the tokens used, not the correction.
FINISH = build_script(
    CorrectionCall,
    FinishCall,
    body="""
local req, n_slots = ARGV[FINISH_A_REQUEST_ID], tonumber(ARGV[FINISH_A_N_SLOTS])
local delta, members = tonumber(ARGV[FINISH_A_DELTA_TOKENS]), tonumber(ARGV[FINISH_A_MEMBERS])
local admitted = tonumber(ARGV[FINISH_A_ADMITTED_US])
local reserved = tonumber(ARGV[FINISH_A_RESERVED_TOKENS])
for i = FINISH_K_SLOTS, FINISH_K_SLOTS + n_slots - 1 do
  redis.call('ZREM', KEYS[i], req)
  for j = 2, members do redis.call('ZREM', KEYS[i], req .. '#' .. j) end
end
local a = FINISH_A_CORRECTIONS - 1
for k = FINISH_K_SLOTS + n_slots - 1, #KEYS - 1, CORRECTION_K_WIDTH do
  local tpm_tat, counter = KEYS[k+CORRECTION_K_TPM_TAT], KEYS[k+CORRECTION_K_TPD_COUNTER]
  local tpm = tonumber(ARGV[a+CORRECTION_A_TPM]); a = a + CORRECTION_A_WIDTH
  if tpm > 0 and delta ~= 0 then
    local tat = redis.call('GET', tpm_tat)
    if tat then
      -- An over-use moves the clock past what admission's TTL covers: stretch the TTL with it,
      -- or the key (and the debt) would vanish before the clock is reached.
      local new_tat = tonumber(tat) + delta * 60000 / tpm
      local ttl = math.ceil(new_tat - now) + 60000
      if ttl > 0 and ttl > redis.call('PTTL', tpm_tat) then
        redis.call('SET', tpm_tat, string.format('%.3f', new_tat), 'PX', ttl)
      else
        redis.call('SET', tpm_tat, string.format('%.3f', new_tat), 'KEEPTTL')
      end
    end
  end
  if counter ~= '' and redis.call('EXISTS', counter) == 1 then
    local add = delta
    local rebuilt = redis.call('GET', KEYS[k+CORRECTION_K_TPD_REBUILT])
    if rebuilt and tonumber(rebuilt) > admitted then add = delta + reserved end
    if add ~= 0 then redis.call('INCRBY', counter, add) end
  end
end
if ARGV[FINISH_A_USAGE_JSON] ~= '' then
  redis.call('RPUSH', KEYS[FINISH_K_USAGE_LIST], ARGV[FINISH_A_USAGE_JSON])
end
-- After its own record is queued, in the same step: the open one is never queued beside it.
if ARGV[FINISH_A_CLOSE_OPEN] == '1' then
  redis.call('HDEL', KEYS[FINISH_K_USAGE_OPEN], req)
  redis.call('ZREM', KEYS[FINISH_K_USAGE_OPEN_LEASES], req)
end
return 1
""",
)

# A missing daily counter, rebuilt from the database (`RebuildDayCall`): set only if still missing
# (another process may have rebuilt it meanwhile), with the time of the rebuild, which `FINISH` reads.
REBUILD_DAY = build_script(
    RebuildDayCall,
    body="""
if redis.call('SET', KEYS[REBUILD_K_COUNTER], ARGV[REBUILD_A_TOKENS], 'NX', 'PX', 2 * 86400000) then
  redis.call('SET', KEYS[REBUILD_K_REBUILT_MARKER], string.format('%.0f', now_us), 'PX', 2 * 86400000)
  return 1
end
return 0
""",
)

# An admission whose reply was lost (a Redis timeout): leave every slot and queue it may hold and,
# only if its reservation record says it was admitted, give back its request and tokens, once
# (`GiveBackCall`).
GIVE_BACK = build_script(
    GiveBackScopeCall,
    GiveBackCall,
    clock=False,
    body="""
local req, members = ARGV[GIVE_BACK_A_REQUEST_ID], tonumber(ARGV[GIVE_BACK_A_MEMBERS])
local n = tonumber(ARGV[GIVE_BACK_A_N_ZSETS])
for i = GIVE_BACK_K_ZSETS, GIVE_BACK_K_ZSETS + n - 1 do
  redis.call('ZREM', KEYS[i], req)
  for j = 2, members do redis.call('ZREM', KEYS[i], req .. '#' .. j) end
end
local taken = redis.call('GET', KEYS[GIVE_BACK_K_RESERVATION])
if not taken then return 0 end
redis.call('DEL', KEYS[GIVE_BACK_K_RESERVATION])
local sep = string.find(taken, ':', 1, true)
local day, cost = string.sub(taken, 1, sep - 1), tonumber(string.sub(taken, sep + 1))
local a = GIVE_BACK_A_SCOPES - 1
for k = GIVE_BACK_K_ZSETS + n - 1, #KEYS - 1, RETURN_K_WIDTH do
  local rpm, tpm = tonumber(ARGV[a+RETURN_A_RPM]), tonumber(ARGV[a+RETURN_A_TPM])
  local tpd = tonumber(ARGV[a+RETURN_A_TPD])
  a = a + RETURN_A_WIDTH
  local back = {}
  if rpm > 0 then back[#back+1] = {KEYS[k+RETURN_K_RPM_TAT], 60000 / rpm} end
  if tpm > 0 and cost > 0 then back[#back+1] = {KEYS[k+RETURN_K_TPM_TAT], cost * 60000 / tpm} end
  for _, b in ipairs(back) do
    local tat = redis.call('GET', b[1])
    if tat then redis.call('SET', b[1], string.format('%.3f', tonumber(tat) - b[2]), 'KEEPTTL') end
  end
  local tpd_day = KEYS[k+RETURN_K_TPD_PREFIX] .. day
  if tpd > 0 and cost > 0 and redis.call('EXISTS', tpd_day) == 1 then
    redis.call('DECRBY', tpd_day, cost)
  end
end
return 1
""",
)

# Renew this process's leases (`RenewCall`). A plain ZADD, not `XX`: a member this process still
# holds is put back if it lapsed (a renewal round that failed, a Redis restart that lost the sets);
# the caller stops renewing a member, and waits for a round in flight (`LeaseKeeper.settled`),
# before removing it.
RENEW = build_script(
    RenewCall,
    body="""
local lease = tonumber(ARGV[RENEW_A_LEASE_MS])
local p = RENEW_A_COUNTED_MEMBERS
for i = RENEW_K_ZSETS, #KEYS do
  local count = tonumber(ARGV[p]); p = p + 1
  for j = 1, count do
    redis.call('ZADD', KEYS[i], now + lease, ARGV[p]); p = p + 1
  end
end
return 1
""",
)
