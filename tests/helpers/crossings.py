"""Counting a request's crossings between two packages of the portal.

A crossing is a call from a function of one package into a function of the other (either way);
the same caller and callee count once however often the call is made (a loop, a chunk). Both the
event loop's thread and the threads `sync_to_async` uses are watched.
"""

from __future__ import annotations

import sys
import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _package(filename: str, packages: dict[str, str]) -> str | None:
    for name, prefix in packages.items():
        if filename.startswith(prefix):
            return name
    return None


def count_crossings(run: Callable[[], object], *packages: str) -> Counter[tuple[str, str]]:
    """Run `run()` and count its calls between `packages` (repository paths such as "portal/gateway"):
    (caller, callee) → calls, each named `path:function`."""
    prefixes = {name: str(ROOT / name) + "/" for name in packages}
    seen: Counter[tuple[str, str]] = Counter()

    def profile(frame, event, _arg):
        if event != "call" or frame.f_back is None:
            return
        callee = _package(frame.f_code.co_filename, prefixes)
        if callee is None:
            return
        caller_code = frame.f_back.f_code
        caller = _package(caller_code.co_filename, prefixes)
        if caller is not None and caller != callee:
            seen[(_name(caller_code), _name(frame.f_code))] += 1

    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return seen


def _name(code) -> str:
    return f"{Path(code.co_filename).relative_to(ROOT).as_posix()}:{code.co_qualname}"
