"""The one application error type that services raise.

Views turn it into a form error, an API 400 (portal.core.api) or a command
error; `field` says which input was wrong so the message can sit next to it.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any

from django.db import models

from inference.errors import InputError


class ApplicationError(Exception):
    def __init__(self, message: str, *, field: str = "", extra: dict[str, Any] | None = None) -> None:
        self.message = message
        self.field = field
        self.extra = extra or {}
        super().__init__(message)

    @classmethod
    def from_input_error(cls, error: InputError, *, field: str | None = None) -> ApplicationError:
        return cls(error.message, field=field if field is not None else error.field)


def clean_or_raise(instance: models.Model, *, exclude: list[str] | None = None) -> None:
    """Run a model's `full_clean()`, turning Django's ValidationError into an ApplicationError
    that names the first offending field (services raise one error type)."""
    from django.core.exceptions import NON_FIELD_ERRORS, ValidationError

    try:
        instance.full_clean(exclude=exclude)
    except ValidationError as error:
        field, messages = next(iter(error.message_dict.items()))
        raise ApplicationError(
            "; ".join(messages), field="" if field == NON_FIELD_ERRORS else field
        ) from error


def did_you_mean(name: str, candidates: Iterable[str]) -> str:
    """ " Did you mean `x`?" naming the closest of `candidates` to a mistyped `name`, else ""."""
    close = difflib.get_close_matches(name, sorted(set(candidates) - {name}), n=1, cutoff=0.6)
    return f" Did you mean `{close[0]}`?" if close else ""
