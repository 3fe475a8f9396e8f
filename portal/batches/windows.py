"""Run windows: "HH:MM-HH:MM" in the portal's time zone (TIME_ZONE), across midnight allowed."""

from __future__ import annotations

import datetime as dt

from django.utils import timezone


def _bounds(window: str) -> tuple[dt.time, dt.time]:
    start, _, end = window.partition("-")
    return dt.time.fromisoformat(start), dt.time.fromisoformat(end)


def within_window(window: str, now: dt.datetime) -> bool:
    """Whether `now` falls in `window` ("20:00-07:00" runs from 20:00 to 07:00 the next morning;
    equal bounds: always)."""
    start, end = _bounds(window)
    moment = timezone.localtime(now).time()
    if start == end:
        return True
    if start < end:
        return start <= moment < end
    return moment >= start or moment < end


def next_window_start(window: str, now: dt.datetime) -> dt.datetime:
    """When `window` next opens after `now` (for the batch page's "waits until")."""
    start, _ = _bounds(window)
    local = timezone.localtime(now)
    opening = local.replace(hour=start.hour, minute=start.minute, second=0, microsecond=0)
    if opening <= local:
        opening += dt.timedelta(days=1)
    return opening
