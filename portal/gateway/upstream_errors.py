"""The upstream client's errors (upstream.py): failures are OSError subclasses (`UpstreamError`) and
timeouts TimeoutError subclasses, so the gateway tells a replica that failed (another may be tried)
from one that was slow."""

from __future__ import annotations


class UpstreamError(ConnectionError):
    """The replica failed us: refused, reset, closed early or spoke broken HTTP."""

    code = "upstream_error"  # the error code the client sees when no other replica answers


class UpstreamProtocolError(UpstreamError):
    """The replica answered what a pass-through cannot relay: `101 Switching Protocols`."""

    code = "upstream_protocol_error"


class UpstreamTooLarge(UpstreamError):
    """The replica's head or whole answer is over its cap."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


class NameNotResolved(UpstreamError):
    """The replica's host name does not resolve (socket.gaierror): it is unreachable from here."""


class ConnectTimeout(TimeoutError):
    """No connection within GATEWAY_CONNECT_TIMEOUT_S: the replica is unreachable (try another)."""


class PoolTimeout(TimeoutError):
    """Every connection of this process was busy for GATEWAY_CONNECT_TIMEOUT_S."""


class ReadTimeout(TimeoutError):
    """Upstream sent nothing for GATEWAY_READ_TIMEOUT_S."""


class HeadTimeout(ReadTimeout):
    """Upstream's head took longer than GATEWAY_UPSTREAM_HEAD_TIMEOUT_S from its first byte."""


# Errors that mean "this replica failed us" (OSError covers refused and reset connections).
UPSTREAM_ERRORS = (OSError,)
