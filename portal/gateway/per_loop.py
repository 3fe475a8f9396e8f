"""One value per running event loop: the gateway's per-loop singletons (the Redis client, limiter
and lease keeper of views.py; the upstream connection pool of upstream.py) all use this.

uvicorn runs one loop per process, but tests and `asyncio.run` start one after another, and a
value made on one loop (a connection, a future) fails on the next. A loop is told by its identity,
not only its `id()`: a closed loop's id may be reused by the next one, which must not inherit
its connections. Closed loops' values are dropped when a new loop asks.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class PerLoop(Generic[T]):
    """`get()` is `make()`'s value for the running loop, made on its first call there."""

    def __init__(self, make: Callable[[], T]) -> None:
        self._make = make
        self._values: dict[int, tuple[asyncio.AbstractEventLoop, T]] = {}

    def get(self) -> T:
        loop = asyncio.get_running_loop()
        found = self._values.get(id(loop))
        if found is not None and found[0] is loop:
            return found[1]
        for key, (other, _value) in list(self._values.items()):
            if other.is_closed():
                del self._values[key]
        value = self._make()
        self._values[id(loop)] = (loop, value)
        return value

    def clear(self) -> None:
        """Forget every loop's value (tests that change settings the values were made with)."""
        self._values.clear()
