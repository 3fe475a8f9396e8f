"""Keeps the request being served where `audit_event_record` finds it (actor, client address)."""

from __future__ import annotations

from .services import current_request


class AuditContextMiddleware:
    """Makes the request (its user, its address) known to `audit_event_record` while it is served."""

    def __init__(self, get_response) -> None:
        self.get_response = get_response

    def __call__(self, request):
        token = current_request.set(request)
        try:
            return self.get_response(request)
        finally:
            current_request.reset(token)
