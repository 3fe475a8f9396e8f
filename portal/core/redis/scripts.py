"""Every Lua script the portal runs in Redis, and the layout of each one's KEYS and ARGV.

A script reads its keys and arguments by position, and its caller must put them in that order.
So each script has a call record (a frozen dataclass, `...Call`) whose fields, in order, are its
KEYS and ARGV: the caller fills in fields by name and sends `call.keys()` and `call.args()`, and the
script reads positions by names declared at the top of its source from the same record
(`<PREFIX>_K_<FIELD>` and `<PREFIX>_A_<FIELD>`, 1-based as Lua counts). Neither side spells a number.

A record may hold another record's fields (`group`): a fixed one (the team's quotas within an
admission) adds its fields in place, a list of them (one per replica) comes last in KEYS or ARGV
and its element width is declared too (`<PREFIX>_K_WIDTH`). A list of plain keys or arguments
(`KEY_LIST`, `ARG_LIST`) also comes last; anything after it has no fixed position and the script
counts its way there.

Time in every script is Redis's own clock (`TIME`, spelled once here as `_NOW`), never a caller's,
so processes with skewed clocks agree.

Pure Python; no Django.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

_PART = "redis_part"
KEYS, ARGV, GROUP = "KEYS", "ARGV", "group"


# A field's metadata says where it goes: `field(metadata=KEY)` is one of the script's KEYS, `KEY_LIST`
# a list of them (last in KEYS); the same for ARGV; `group(Record)` holds another record's fields.
KEY: dict[str, Any] = {_PART: KEYS, "many": False}
KEY_LIST: dict[str, Any] = {_PART: KEYS, "many": True}
ARG: dict[str, Any] = {_PART: ARGV, "many": False}
ARG_LIST: dict[str, Any] = {_PART: ARGV, "many": True}


def group(record: type[ScriptCall], *, many: bool = False) -> dict[str, Any]:
    """Metadata of a field holding another record (or, with `many`, a list of them): its keys go in
    KEYS and its arguments in ARGV, where this field stands."""
    return {_PART: GROUP, "record": record, "many": many}


class ScriptCall:
    """What one script is called with, by name. Subclasses are frozen dataclasses of `key`, `arg`
    and `group` fields, and name their Lua prefix."""

    LUA_PREFIX: ClassVar[str]

    def keys(self) -> list[str]:
        return _flatten(self, KEYS)

    def args(self) -> list[Any]:
        return _flatten(self, ARGV)

    @classmethod
    def lua_positions(cls) -> str:
        """Lua locals naming where each field sits: `<PREFIX>_K_<FIELD> = <position>` (and the
        same with `_A_` for ARGV), plus `<PREFIX>_K_WIDTH` when the record has a fixed size."""
        names: list[str] = []
        values: list[int] = []
        for part, letter in ((KEYS, "K"), (ARGV, "A")):
            positions, width = _positions(cls, part)
            for name, position in positions.items():
                names.append(f"{cls.LUA_PREFIX}_{letter}_{name.upper()}")
                values.append(position)
            if width is not None and positions:
                names.append(f"{cls.LUA_PREFIX}_{letter}_WIDTH")
                values.append(width)
        return f"local {', '.join(names)} = {', '.join(map(str, values))}\n"


# Per record class and part, a function that lists its fields in that part, written out once:
# the gateway flattens two records (four lists) per request, and walking `fields()` and the
# groups for each was about 28 µs of CPU per script call (docs/decisions.md, "The gateway's
# own cost, fourth pass"). The code is generated from the record's own field names, nothing else.
_FLATTENERS: dict[tuple[type, str], Callable[[ScriptCall], list[Any]]] = {}


def _flatten(record: ScriptCall, part: str) -> list[Any]:
    flatten = _FLATTENERS.get((type(record), part))
    if flatten is None:
        flatten = _FLATTENERS[(type(record), part)] = _flattener(type(record), part)
    return flatten(record)


def _flattener(record: type[ScriptCall], part: str) -> Callable[[ScriptCall], list[Any]]:
    """`def flatten(r)` appending `r`'s fields of `part` in order, groups' fields in place."""
    lines = ["def flatten(r):", "    out = []"]
    names = itertools.count()

    def emit(var: str, cls: type, indent: str) -> None:
        for f in fields(cls):
            kind, many = f.metadata.get(_PART), f.metadata.get("many")
            if kind == GROUP:
                inner = f"g{next(names)}"
                if many:
                    lines.append(f"{indent}for {inner} in {var}.{f.name}:")
                    body = len(lines)
                    emit(inner, f.metadata["record"], indent + "    ")
                    if len(lines) == body:
                        lines.append(f"{indent}    pass")
                else:
                    lines.append(f"{indent}{inner} = {var}.{f.name}")
                    emit(inner, f.metadata["record"], indent)
            elif kind == part and many:
                lines.append(f"{indent}out += {var}.{f.name}")
            elif kind == part:
                lines.append(f"{indent}out.append({var}.{f.name})")

    emit("r", record, "    ")
    lines.append("    return out")
    namespace: dict[str, Any] = {}
    exec("\n".join(lines), namespace)  # noqa: S102  (field names of the portal's own records)
    return namespace["flatten"]


def _positions(record: type[ScriptCall], part: str) -> tuple[dict[str, int], int | None]:
    """Each field's 1-based position in `part` up to the first list, and the record's width in
    `part` (None when a list makes it vary)."""
    positions: dict[str, int] = {}
    at = 1
    for f in fields(record):  # type: ignore[arg-type]
        kind = f.metadata.get(_PART)
        if kind == GROUP:
            inner, width = _positions(f.metadata["record"], part)
            if not inner:
                continue
            positions[f.name] = at
            if f.metadata["many"] or width is None:
                return positions, None
            at += width
        elif kind == part:
            positions[f.name] = at
            if f.metadata["many"]:
                return positions, None
            at += 1
    return positions, at - 1


def _script(*records: type[ScriptCall], body: str, clock: bool = True) -> str:
    """A script's source: the positions of its records' fields, Redis's time, then its body."""
    source = "".join(record.lua_positions() for record in records) + (_NOW if clock else "") + body
    _check_names(source, records)
    return source


_LUA_NAME = re.compile(r"\b([A-Z][A-Z0-9_]*_[KA]_[A-Z0-9_]+)\b")


def _check_names(source: str, records: tuple[type[ScriptCall], ...]) -> None:
    """Every position a script's body names is declared (a misspelt one would be a nil global
    at run time, in Redis, on one rarely taken branch)."""
    declared = set()
    for record in records:
        line = record.lua_positions()
        declared |= set(line.removeprefix("local ").split(" = ")[0].split(", "))
    missing = set(_LUA_NAME.findall(source)) - declared
    if missing:
        raise ValueError(f"Lua positions used but not declared: {sorted(missing)}")


# Redis's time: `now` in ms, `now_us` in µs.
_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
"""


# --- admission: quotas, blocks, replica slots (portal/core/redis/ratelimit.py) ----------------


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
ADMIT = _script(QuotaCall, AdmitCall, body=_ADMIT_BODY + "return {'ok', 0, day, now_us}")

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
ACQUIRE = _script(
    ReplicaCall,
    AcquireCall,
    body=_ACQUIRE_FN + "local index, position = acquire(0, 0)\nreturn {index, position}",
)

# ADMIT then, if admitted, ACQUIRE: one round trip for the common case (admitted, a slot free).
# Returns {status, retry_after_ms, day, index, position, now_us}.
ADMIT_PLACE = _script(
    QuotaCall,
    AdmitCall,
    ReplicaCall,
    AcquireCall,
    AdmitPlaceCall,
    body=_ACQUIRE_FN
    + _ADMIT_BODY
    + "local index, position = acquire(ADMIT_PLACE_K_ACQUIRE - 1, ADMIT_PLACE_A_ACQUIRE - 1)\n"
    + "return {'ok', 0, day, index, position, now_us}",
)

# Leave every slot a request held, correct its reservation to the tokens used, queue its usage
# record (`FinishCall`). A daily counter rebuilt from the database after this request was admitted
# never held its reservation (a Redis restart lost it; the record is not in the database yet): it
# gets the tokens used, not the correction.
FINISH = _script(
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
return 1
""",
)

# A missing daily counter, rebuilt from the database (`RebuildDayCall`): set only if still missing
# (another process may have rebuilt it meanwhile), with the time of the rebuild, which `FINISH` reads.
REBUILD_DAY = _script(
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
GIVE_BACK = _script(
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
RENEW = _script(
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


# --- the usage flush (portal/teams) ---------------------------------------------------------


@dataclass(frozen=True)
class UsageTakeCall(ScriptCall):
    LUA_PREFIX = "TAKE"
    usage: str = field(metadata=KEY)
    flushers: str = field(metadata=KEY)
    batch_list: str = field(metadata=KEY)  # this flusher's own
    batch_size: int = field(metadata=ARG)
    lease_ms: int = field(metadata=ARG)
    flusher: str = field(metadata=ARG)


@dataclass(frozen=True)
class UsageGiveBackCall(ScriptCall):
    LUA_PREFIX = "REQUEUE"
    usage: str = field(metadata=KEY)
    flushers: str = field(metadata=KEY)
    batch_list: str = field(metadata=KEY)
    flusher: str = field(metadata=ARG)
    force: str = field(metadata=ARG)  # '1' = even if its lease still runs


@dataclass(frozen=True)
class UsageReplayCall(ScriptCall):
    LUA_PREFIX = "REPLAY"
    dead: str = field(metadata=KEY)
    usage: str = field(metadata=KEY)
    kept_reason: str = field(metadata=ARG)  # dead letters of this reason stay


# Moves up to `batch_size` records from the queue to the flusher's own list in one step
# (`UsageTakeCall`), so two flushers never take the same records, and a dead flusher's batch can be
# put back.
USAGE_TAKE = _script(
    UsageTakeCall,
    body="""
local raws = redis.call('LRANGE', KEYS[TAKE_K_USAGE], 0, tonumber(ARGV[TAKE_A_BATCH_SIZE]) - 1)
if #raws == 0 then return raws end
redis.call('LTRIM', KEYS[TAKE_K_USAGE], #raws, -1)
for i = 1, #raws, 500 do
  redis.call('RPUSH', KEYS[TAKE_K_BATCH_LIST], unpack(raws, i, math.min(i + 499, #raws)))
end
redis.call('ZADD', KEYS[TAKE_K_FLUSHERS], now + tonumber(ARGV[TAKE_A_LEASE_MS]), ARGV[TAKE_A_FLUSHER])
return raws
""",
)

# Puts a batch back on the queue (`UsageGiveBackCall`): its flusher's lease ran out (it died), or it
# gave up on it.
USAGE_GIVE_BACK = _script(
    UsageGiveBackCall,
    body="""
local lease_end = redis.call('ZSCORE', KEYS[REQUEUE_K_FLUSHERS], ARGV[REQUEUE_A_FLUSHER])
if ARGV[REQUEUE_A_FORCE] ~= '1' and lease_end and tonumber(lease_end) > now then return 0 end
local raws = redis.call('LRANGE', KEYS[REQUEUE_K_BATCH_LIST], 0, -1)
for i = 1, #raws, 500 do
  redis.call('RPUSH', KEYS[REQUEUE_K_USAGE], unpack(raws, i, math.min(i + 499, #raws)))
end
redis.call('DEL', KEYS[REQUEUE_K_BATCH_LIST])
redis.call('ZREM', KEYS[REQUEUE_K_FLUSHERS], ARGV[REQUEUE_A_FLUSHER])
return #raws
""",
)


@dataclass(frozen=True)
class UsageOpenCall(ScriptCall):
    LUA_PREFIX = "OPEN"
    open: str = field(metadata=KEY)
    open_leases: str = field(metadata=KEY)
    request_id: str = field(metadata=ARG)
    record: str = field(metadata=ARG)
    lease_ms: int = field(metadata=ARG)


# Leaves the record a request would leave if its gateway process died, under a lease by Redis's clock
# (renewed with the request's slots, `LeaseKeeper`), until the request finishes and removes it.
USAGE_OPEN = _script(
    UsageOpenCall,
    body="""
redis.call('HSET', KEYS[OPEN_K_OPEN], ARGV[OPEN_A_REQUEST_ID], ARGV[OPEN_A_RECORD])
redis.call('ZADD', KEYS[OPEN_K_OPEN_LEASES], now + tonumber(ARGV[OPEN_A_LEASE_MS]), ARGV[OPEN_A_REQUEST_ID])
return 1
""",
)


@dataclass(frozen=True)
class UsageCloseLapsedCall(ScriptCall):
    LUA_PREFIX = "LAPSED"
    open: str = field(metadata=KEY)
    open_leases: str = field(metadata=KEY)
    usage: str = field(metadata=KEY)
    batch_size: int = field(metadata=ARG)


# In one step, queues the open record of each request whose lease lapsed (its gateway process died:
# a live one renews it) as its usage record, as the gateway wrote it, and forgets it. Returns how
# many it queued. The record is not re-encoded: cjson would round `created_at`, which with the request
# id makes a record unique (a record the request also queued itself is then stored once).
USAGE_CLOSE_LAPSED = _script(
    UsageCloseLapsedCall,
    body="""
local ids = redis.call('ZRANGEBYSCORE', KEYS[LAPSED_K_OPEN_LEASES], '-inf', now, 'LIMIT', 0,
  tonumber(ARGV[LAPSED_A_BATCH_SIZE]))
local queued = 0
for _, id in ipairs(ids) do
  local raw = redis.call('HGET', KEYS[LAPSED_K_OPEN], id)
  if raw then
    redis.call('RPUSH', KEYS[LAPSED_K_USAGE], raw)
    queued = queued + 1
  end
  redis.call('HDEL', KEYS[LAPSED_K_OPEN], id)
  redis.call('ZREM', KEYS[LAPSED_K_OPEN_LEASES], id)
end
return queued
""",
)

# In one step, moves every dead-lettered record back to the queue except those of the kept reason,
# which stay dead-lettered (`UsageReplayCall`). Returns {replayed, kept}.
USAGE_REPLAY = _script(
    UsageReplayCall,
    clock=False,
    body="""
local entries = redis.call('LRANGE', KEYS[REPLAY_K_DEAD], 0, -1)
local kept = {}
for _, entry in ipairs(entries) do
  local decoded = cjson.decode(entry)
  if decoded['reason'] == ARGV[REPLAY_A_KEPT_REASON] then
    table.insert(kept, entry)
  else
    redis.call('RPUSH', KEYS[REPLAY_K_USAGE], decoded['record'])
  end
end
redis.call('DEL', KEYS[REPLAY_K_DEAD])
for i = 1, #kept, 500 do
  redis.call('RPUSH', KEYS[REPLAY_K_DEAD], unpack(kept, i, math.min(i + 499, #kept)))
end
return {#entries - #kept, #kept}
""",
)


# --- the dashboard's per-minute maxima (portal/observability) ----------------------------------


@dataclass(frozen=True)
class MinuteMaxCall(ScriptCall):
    LUA_PREFIX = "MAX"
    minute: str = field(metadata=KEY)  # the minute's hash
    name: str = field(metadata=ARG)
    value: int = field(metadata=ARG)
    ttl_s: int = field(metadata=ARG)


# Keep the larger of the stored and the given value of one field of a minute's hash (`MinuteMaxCall`).
MINUTE_MAX = _script(
    MinuteMaxCall,
    clock=False,
    body="""
local minute, name = KEYS[MAX_K_MINUTE], ARGV[MAX_A_NAME]
local cur = tonumber(redis.call('HGET', minute, name) or '-1')
if tonumber(ARGV[MAX_A_VALUE]) > cur then redis.call('HSET', minute, name, ARGV[MAX_A_VALUE]) end
redis.call('EXPIRE', minute, ARGV[MAX_A_TTL_S])
return 1
""",
)
