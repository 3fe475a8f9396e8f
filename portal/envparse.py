"""How the settings read a variable: strictly, within bounds, stopping the start on a bad value.

django-environ parses; these add what it lets through (a typo read as False, "15s" read as 15, a
0 or negative limit that would turn a limit off). portal/settings.py says which variables there are.
"""

from __future__ import annotations

import ipaddress
import math
from typing import overload

import environ
from django.core.exceptions import ImproperlyConfigured

env = environ.Env()

_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}


def env_bool(name: str, *, default: bool) -> bool:
    """A boolean variable, strictly: anything but true/false/1/0/yes/no/on/off stops the start.

    (django-environ reads any unknown word as False, which hides typos like DEBUG=ture.)
    """
    raw = env.str(name, default="").strip().lower()
    if not raw:
        return default
    if raw in _TRUE | _FALSE:
        return raw in _TRUE
    raise ImproperlyConfigured(f"{name}={raw!r} is not a boolean; use true or false")


@overload
def env_number(name: str, *, default: int, minimum: int, maximum: int | None = None) -> int: ...
@overload
def env_number(name: str, *, default: float, minimum: float, maximum: float | None = None) -> float: ...
def env_number(
    name: str, *, default: int | float, minimum: int | float, maximum: int | float | None = None
) -> int | float:
    """An int (or, with a float default, a finite float) variable between `minimum` and `maximum`,
    strictly: "15s" or "1e" stops the start (django-environ would strip the letters), and so does a
    0 limit, which would refuse everything (or a 0 timeout, which would fail everything). Every
    numeric setting is read through here, so none can turn a limit off by being 0, negative or huge."""
    raw = env.str(name, default="").strip()
    if not raw:
        return default
    try:
        value = float(raw) if isinstance(default, float) else int(raw)
    except ValueError as error:
        raise ImproperlyConfigured(
            f"{name}={raw!r} is not {'a number' if isinstance(default, float) else 'an integer'}"
        ) from error
    if not math.isfinite(value) or value < minimum or (maximum is not None and value > maximum):
        bounds = f"at least {minimum}" if maximum is None else f"between {minimum} and {maximum}"
        raise ImproperlyConfigured(f"{name}={raw!r} must be a number {bounds}")
    return value


def env_positive_int(name: str, *, default: int, maximum: int | None = None) -> int:
    return int(env_number(name, default=default, minimum=1, maximum=maximum))


def env_retention_days(name: str, *, default: int, least: int = 1) -> int:
    """Days to keep; 0 keeps forever."""
    value = int(env_number(name, default=default, minimum=0, maximum=36_500))
    if value != 0 and value < least:
        raise ImproperlyConfigured(f"{name}={value} must be 0 (keep forever) or at least {least}")
    return value


def env_networks(name: str, *, most: int = 32) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
    """CIDR networks, comma-separated, at most `most`, each written strictly (no host bits)."""
    raw = env.str(name, default="")
    items = [item.strip() for item in raw.split(",") if item.strip()]
    if len(items) > most:
        raise ImproperlyConfigured(f"{name}={raw!r} lists {len(items)} networks; at most {most}")
    try:
        return tuple(ipaddress.ip_network(item, strict=True) for item in items)
    except ValueError as error:
        example = "write networks as 169.254.10.0/24 or fe80::/64"
        raise ImproperlyConfigured(f"{name}={raw!r}: {error} ({example})") from None
