"""A per-process cache for the gateway's database reads (key rows, routes).

Single flight: when an entry is missing, concurrent requests await one load, not
one each (64 streams refreshing a key at once was a one-second stall in the
benchmark). Stale while revalidating, within a grace: an entry expired less than
`grace` ago is served while one background load refreshes it, so no request of a
busy key or model waits on the database; an entry older than that is never
served while a load can replace it: its requests await the one reload (after an
idle 30 s, a cap lowered to 1 let 6 requests in at once from the old entry). So an
answer is at most ttl + grace older than its load, unless the load fails (the
database down), when the old entry is served on, and logged.
Revocation does not depend on this cache (the admission script checks Redis).

Misses (no such key, no such model) are kept apart from hits, each bounded on its
own and evicting its oldest entry: a flood of random key prefixes can only push
out other misses, never a real key's row.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

log = logging.getLogger("portal.gateway")


def _is_none(value) -> bool:
    return value is None


class TtlCache:
    def __init__(
        self,
        ttl: Callable[[], float],
        *,
        name: str = "cache",
        max_entries: int = 10_000,
        max_misses: int = 4_096,
        is_miss: Callable[[Any], bool] = _is_none,
        grace: Callable[[], float] | None = None,
    ) -> None:
        self._ttl = ttl  # read on every use, so tests can change the setting
        # How long past its ttl an entry may still answer while it is refreshed (None: for ever).
        self._grace = grace
        self._name = name  # what the log calls it: "routes", "API keys"
        self._max = max_entries
        self._max_misses = max_misses
        self._is_miss = is_miss
        # Insertion-ordered: the first entry is the one stored or refreshed longest ago.
        self._entries: dict[Any, tuple[float, Any]] = {}
        self._misses: dict[Any, tuple[float, Any]] = {}
        self._loading: dict[Any, asyncio.Future] = {}

    def peek(self, key) -> Any:
        """The cached hit for `key` (fresh or stale), or None; never loads."""
        hit = self._entries.get(key)
        return hit[1] if hit is not None else None

    async def get(self, key, load: Callable[[], Awaitable[Any]]):
        now = time.monotonic()
        hit = self._entries.get(key) or self._misses.get(key)
        if hit is not None:
            age, ttl = now - hit[0], self._ttl()
            if age < ttl:
                return hit[1]
            if self._grace is None or age < ttl + self._grace():
                if key not in self._loading:
                    self._start(key, load)
                return hit[1]
        pending = self._loading.get(key) or self._start(key, load)
        try:
            return await asyncio.shield(pending)
        except Exception:
            if hit is None:
                raise
            # Too old, and its reload failed (`_store` logged why and keeps it): the old entry
            # beats no answer while the database is away.
            return hit[1]

    def _start(self, key, load) -> asyncio.Future:
        task = asyncio.ensure_future(load())
        self._loading[key] = task
        task.add_done_callback(lambda t: self._store(key, t))
        return task

    def _store(self, key, task: asyncio.Future) -> None:
        self._loading.pop(key, None)
        if task.cancelled():
            return
        error = task.exception()
        if error is not None:
            # A request with nothing cached sees the error itself and the next one tries again. A
            # stale entry hides it: ops must know why a change (a roll-back, a new quota) has not
            # reached this process, and it is tried again one interval later, not by every request
            # (a database outage would otherwise cost a load and a warning per request).
            stale = self._entries if key in self._entries else self._misses if key in self._misses else None
            if stale is not None:
                stale[key] = (time.monotonic(), stale.pop(key)[1])  # re-inserted last, as a store
                log.warning(
                    "refreshing cached %s failed (%s: %s); serving the stale entry until a load succeeds",
                    self._name,
                    type(error).__name__,
                    error,
                )
            return
        value = task.result()
        miss = self._is_miss(value)
        into, other = (self._misses, self._entries) if miss else (self._entries, self._misses)
        limit = self._max_misses if miss else self._max
        other.pop(key, None)
        into.pop(key, None)  # re-inserted last: it is now the newest
        while len(into) >= limit:
            del into[next(iter(into))]
        into[key] = (time.monotonic(), value)
