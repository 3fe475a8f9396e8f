"""Resolving a replica's host name for the upstream client (upstream.py), and saying once per
interval, not once per request, that a name does not resolve."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import time

from .upstream_errors import NameNotResolved

log = logging.getLogger("portal.gateway.upstream")


# A replica whose name does not resolve fails every request sent to it: its error is logged once per
# replica per interval (and counted every time), not once per request.
NAME_ERROR_LOG_INTERVAL_S = 60.0
_name_errors_logged: dict[str, float] = {}


def _retrieve(future: asyncio.Future) -> None:
    """Read a finished lookup's outcome, so a lookup abandoned by a timeout never leaves a
    "Future exception was never retrieved" behind."""
    if not future.cancelled():
        future.exception()


async def resolve(loop: asyncio.AbstractEventLoop, host: str, port: int) -> str:
    """The address to connect to: the name resolved here, its failure as NameNotResolved (logged
    once per replica per NAME_ERROR_LOG_INTERVAL_S, counted in portal_gateway_upstream_connect_errors)."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        pass
    else:
        return host
    lookup = asyncio.ensure_future(loop.getaddrinfo(host, port, type=socket.SOCK_STREAM))
    lookup.add_done_callback(_retrieve)
    try:
        found = await lookup
    except socket.gaierror as error:
        _name_error(host, port, error)
        raise NameNotResolved(f"{host} does not resolve: {error.strerror or error}") from None
    if not found:
        raise NameNotResolved(f"{host} resolves to no address")
    return found[0][4][0]


def _name_error(host: str, port: int, error: socket.gaierror) -> None:
    now = time.monotonic()
    if now - _name_errors_logged.get(host, -NAME_ERROR_LOG_INTERVAL_S) >= NAME_ERROR_LOG_INTERVAL_S:
        _name_errors_logged[host] = now
        log.warning(
            "replica %s:%s is unreachable: its name does not resolve (%s); logged once per %g s",
            host,
            port,
            error.strerror or error,
            NAME_ERROR_LOG_INTERVAL_S,
        )
    # Imported here: this module loads before Django's apps (perf/relay_floor.py), and the
    # metrics module reads the usage models.
    from portal.observability import prometheus

    try:
        prometheus.recorder.add(
            {(prometheus.UPSTREAM_CONNECT_ERRORS, host, "name_resolution"): 1}, {}, at=time.time()
        )
    except Exception:  # counting never fails a request
        log.exception("upstream connect error not counted")
