"""The client's address, by one rule for every part of the portal: the login throttle (axes, for
the login form, the admin and the API's Basic auth), the gateway's failed-key throttle and the
audit log.

The address is the TCP peer (`REMOTE_ADDR`; the web process runs uvicorn with
`--no-proxy-headers`, so it is never taken from a header). Behind `TRUSTED_PROXY_COUNT` reverse
proxies it is the address the outermost of them saw: each proxy appends the address it got the
request from to `X-Forwarded-For`, so that one is the count-th entry from the right; whatever a
client wrote to the left of it is ignored. A request with fewer entries did not come through
every proxy, and keeps its peer.
"""

from __future__ import annotations

import ipaddress

from django.conf import settings
from django.http import HttpRequest


def _address(text: str) -> str | None:
    try:
        return str(ipaddress.ip_address(text.strip()))
    except ValueError:
        return None


def client_address(request: HttpRequest) -> str | None:
    """The client's IP address under the rule above, or None if the peer is not an IP address
    (a Unix socket, a test client without one)."""
    peer = request.META.get("REMOTE_ADDR") or ""
    count = settings.TRUSTED_PROXY_COUNT
    if count:
        header = request.META.get("HTTP_X_FORWARDED_FOR", "")
        forwarded = [entry for entry in header.split(",") if entry.strip()]
        if len(forwarded) >= count:
            return _address(forwarded[-count]) or _address(peer)
    return _address(peer)
