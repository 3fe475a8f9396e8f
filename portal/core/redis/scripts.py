"""The mechanism of the portal's Lua scripts (call records, positions, Redis's clock), and the
scripts of the apps below the gateway (the usage flush, the dashboard's per-minute maxima).

The gateway's own scripts (admission, slots, leases, finish) are in portal/gateway/admission/scripts.py,
built with `build_script` from here.

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


def build_script(*records: type[ScriptCall], body: str, clock: bool = True) -> str:
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
USAGE_TAKE = build_script(
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
USAGE_GIVE_BACK = build_script(
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
USAGE_CLOSE_LAPSED = build_script(
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
USAGE_REPLAY = build_script(
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
MINUTE_MAX = build_script(
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
