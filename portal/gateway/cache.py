"""A per-process cache for the gateway's database reads (key rows, routes).

Single flight: when an entry is missing, concurrent requests await one load, not
one each (64 streams refreshing a key at once was a one-second stall in the
benchmark). Stale while revalidating: an expired entry is served while one
background load refreshes it, so no request waits on the database once warm.
Revocation does not depend on this cache (the admission script checks Redis).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any


class TtlCache:
    def __init__(self, ttl: Callable[[], float], *, max_entries: int = 10_000) -> None:
        self._ttl = ttl  # read on every use, so tests can change the setting
        self._max = max_entries
        self._entries: dict[Any, tuple[float, Any]] = {}
        self._loading: dict[Any, asyncio.Future] = {}

    async def get(self, key, load: Callable[[], Awaitable[Any]]):
        now = time.monotonic()
        hit = self._entries.get(key)
        if hit is not None:
            if now - hit[0] >= self._ttl() and key not in self._loading:
                self._start(key, load)
            return hit[1]
        pending = self._loading.get(key) or self._start(key, load)
        return await asyncio.shield(pending)

    def _start(self, key, load) -> asyncio.Future:
        task = asyncio.ensure_future(load())
        self._loading[key] = task
        task.add_done_callback(lambda t: self._store(key, t))
        return task

    def _store(self, key, task: asyncio.Future) -> None:
        self._loading.pop(key, None)
        if task.cancelled() or task.exception() is not None:
            return  # the next request tries again (and sees the error itself)
        if len(self._entries) >= self._max and key not in self._entries:
            self._entries.clear()  # unknown keys must not grow the cache without bound
        self._entries[key] = (time.monotonic(), task.result())
