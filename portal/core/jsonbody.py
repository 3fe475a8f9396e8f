"""JSON from a request body, where nesting too deep for Python's parser is the client's error.

`json.loads` of 5,000 `[` raises RecursionError, which is not a ValueError: every parser that
caught only ValueError answered 500 (before login, too), and the gateway recorded it as an
upstream error. Walking a parsed body recursively can hit the same limit below the parser's.
"""

from __future__ import annotations

import json
from typing import Any

TOO_DEEP = "The JSON body is nested too deeply."


class JsonTooDeep(ValueError):
    """A body nested deeper than the parser (or a walk of its result) can follow."""

    def __init__(self) -> None:
        super().__init__(TOO_DEEP)


def loads(raw: bytes | str) -> Any:
    """`json.loads`, raising JsonTooDeep (a ValueError) for nesting it cannot follow."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise JsonTooDeep from None
