"""The one error type that inference code raises for bad input."""

from __future__ import annotations


class InputError(ValueError):
    """Bad input that a person can fix: names the field and says what is wrong.

    `field` is the name of the offending setting or config key ("" when the
    problem is not tied to one field). Callers show `str(error)`; it already
    starts with the field name, so no traceback is ever needed to act on it.
    """

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}" if field else message)
