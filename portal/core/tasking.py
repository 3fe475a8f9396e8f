"""What every Celery task that takes a row's id shares: a row that is not there is not an error.

A message can outlive its row: a deployment deleted while its start waited in the queue, or a
broker (Redis) that kept messages from another database. Such a task has nothing to do; it logs
one line and returns None, instead of a `DoesNotExist` traceback and a failed task.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any

from django.apps import apps

logger = logging.getLogger("portal.tasks")


def skip_missing_row(
    model: str, *, arg: str, field: str = "pk"
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorate a task (under `@shared_task`) whose argument `arg` names a `model` row by `field`.

    The row is looked for first; a `DoesNotExist` of that model raised while the row is really gone
    (deleted while the task ran) is absorbed too. Any other error, or that of a row that exists
    (a filter besides the id refused it), is raised as before.
    """

    def decorate(func: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(func)

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            value = signature.bind(*args, **kwargs).arguments[arg]
            model_class = apps.get_model(model)
            rows = model_class._default_manager.filter(**{field: value})

            def gone() -> None:
                logger.warning(
                    "%s: no %s with %s=%r (deleted, or never in this database); nothing to do",
                    func.__qualname__,
                    model_class._meta.label,
                    field,
                    value,
                )

            if not rows.exists():
                return gone()
            try:
                return func(*args, **kwargs)
            except model_class.DoesNotExist:
                if rows.exists():
                    raise
                return gone()

        # Celery reads the signature to check a call's arguments when it is sent.
        wrapper.__signature__ = signature  # type: ignore[attr-defined]  # typeshed's _Wrapped omits it
        return wrapper

    return decorate
