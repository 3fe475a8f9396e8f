"""A locked-out API client gets a 429, as the login form does (axes' middleware answers for pages).

DRF's Basic authentication calls `authenticate()` with its own Request object, so the flag axes
leaves for its middleware never reaches the HttpRequest; without this, a locked-out client would
get the plain 401 of a wrong password and keep guessing.
"""

from __future__ import annotations

from axes.signals import user_locked_out
from django.conf import settings
from django.dispatch import receiver
from rest_framework.exceptions import Throttled
from rest_framework.request import Request


@receiver(user_locked_out)
def refuse_locked_out_api_client(sender, request=None, **kwargs) -> None:
    if isinstance(request, Request):
        raise Throttled(
            wait=settings.AXES_COOLOFF_TIME.total_seconds(),
            detail="Too many failed logins from this address; try again later.",
        )
