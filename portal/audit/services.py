"""The one way to write the audit log.

Services and API views call `audit_event_record`; the actor and the client address
come from the request being served (`AuditContextMiddleware` keeps it in a context
variable) unless given. Outside a request (a management command, a Celery task) the
actor is `system`.
"""

from __future__ import annotations

import contextvars
import datetime as dt
import decimal
import uuid

from django.db import models

from portal.core.clientaddr import client_address

from .models import AuditEvent

current_request: contextvars.ContextVar = contextvars.ContextVar("audit_request", default=None)


def _plain(value):
    """A JSON-safe copy of a field value."""
    if isinstance(value, models.Model):
        return str(value)
    if isinstance(value, dt.datetime | dt.date | uuid.UUID | decimal.Decimal):
        return str(value)
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


# Never written to the log, whatever the model.
SECRET_FIELDS = {"digest", "password", "engine_api_key"}


def field_values(instance: models.Model, fields: list[str] | None = None) -> dict:
    """Concrete field values by name (foreign keys as their objects' text), secrets left out."""
    names = fields or [f.name for f in instance._meta.concrete_fields]
    values = {}
    for name in names:
        if name in SECRET_FIELDS or name == "id":
            continue
        values[name] = _plain(getattr(instance, name, None))
    return values


def changed_fields(before: dict, after: dict) -> dict:
    """{field: [before, after]} for the fields whose value differs."""
    return {
        k: [before.get(k), after.get(k)]
        for k in sorted(set(before) | set(after))
        if before.get(k) != after.get(k)
    }


def _client_ip(request) -> str | None:
    """The client's address, by the rule the login throttle and the gateway use."""
    return client_address(request)


def audit_event_record(
    *,
    action: str,
    target: models.Model | None = None,
    changes: dict | None = None,
    actor=None,
    target_type: str = "",
    target_id: str = "",
    target_repr: str = "",
) -> AuditEvent:
    """Append one event. `target` fills type/id/repr; without it, give them (e.g. a deleted row)."""
    request = current_request.get()
    if actor is None and request is not None:
        user = getattr(request, "user", None)
        actor = user if user is not None and user.is_authenticated else None
    if target is not None:
        target_type = target_type or target._meta.label_lower
        target_id = target_id or str(target.pk)
        target_repr = target_repr or str(target)
    return AuditEvent.objects.create(
        actor=actor,
        actor_repr=actor.get_username() if actor is not None else "system",
        action=action,
        target_type=target_type,
        target_id=target_id,
        target_repr=target_repr[:200],
        changes=_plain(changes or {}),
        ip=_client_ip(request) if request is not None else None,
    )
