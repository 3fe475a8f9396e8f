"""The one polling helper: wait for an event with a deadline, failing with what was awaited."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(
    predicate: Callable[[], T], *, what: str, timeout_s: float = 30.0, interval_s: float = 0.05
) -> T:
    """Poll `predicate` until it returns something truthy, and return that.

    Fails with "not <what> after <timeout_s> s" once the deadline passes; the predicate is
    asked once more at the deadline, so a slow machine never fails a test that just made it.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not {what} after {timeout_s:g} s")
        time.sleep(interval_s)
