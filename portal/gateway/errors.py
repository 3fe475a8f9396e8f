"""OpenAI-shaped errors: `{"error": {"message", "type", "code"}}`, as a response or an SSE event."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager

from django.http import HttpResponse
from redis.exceptions import RedisError

from portal.teams.models import UsageStatus

log = logging.getLogger("portal.gateway")

TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "api_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "timeout_error",
}


class GatewayError(Exception):
    """A request the gateway answers itself. `usage_status` is what its usage record says: by
    default a refusal for a 4xx (the caller's doing) and an outage for a 5xx (the portal's)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str,
        retry_after: float | None = None,
        usage_status: UsageStatus | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.retry_after = retry_after
        if usage_status is None:
            usage_status = UsageStatus.UNAVAILABLE if status >= 500 else UsageStatus.REJECTED
        self.usage_status = usage_status
        self.param = param

    def payload(self) -> bytes:
        error = {"message": self.message, "type": TYPES.get(self.status, "api_error"), "code": self.code}
        if self.param:
            error["param"] = self.param
        return json.dumps({"error": error}).encode()


def invalid_request(message: str, param: str, code: str = "invalid_value") -> GatewayError:
    """A 400 that names the request field at fault."""
    return GatewayError(400, message, code=code, param=param)


def body_too_large(limit: int) -> GatewayError:
    """The one 413: a body over GATEWAY_MAX_BODY_BYTES (sent by the edge, portal.core.bodylimit)."""
    return GatewayError(413, f"Request body is over {limit} bytes.", code="request_too_large")


def limiter_unavailable() -> GatewayError:
    """Without Redis no quota or slot can be checked: refuse (never admit unlimited), retry soon."""
    return GatewayError(
        503,
        "The rate limiter is unavailable; retry shortly.",
        code="rate_limiter_unavailable",
        retry_after=2,
    )


@contextmanager
def redis_required(request_id: str = "") -> Iterator[None]:
    """The one translation of a Redis failure on a request's path: the 503 of `limiter_unavailable`.
    Wraps each entry point (a view's whole pipeline); the steps inside let RedisError rise."""
    try:
        yield
    except RedisError as error:
        log.warning("gateway request %s: Redis unavailable: %r", request_id or "-", error)
        raise limiter_unavailable() from None


def database_unavailable() -> GatewayError:
    """A key or route the process has not cached, while PostgreSQL is unreachable (restarting)."""
    message = "The portal's database is unavailable; retry shortly."
    return GatewayError(503, message, code="database_unavailable", retry_after=2)


def is_json_media(content_type: str) -> bool:
    """`application/json` or a `+json` type, whatever its parameters."""
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or media.endswith("+json")


def upstream_answer(status: int, content: bytes, content_type: str) -> tuple[int, bytes]:
    """(status, JSON body) the client gets of an upstream's whole answer. An engine answers JSON
    (its result, or its OpenAI error: passed on as is); anything else (an HTML error page of
    whatever listens at that address, a proxy's or a metadata service's) never reaches the client
    on the portal's origin: the gateway's own error for that status instead, 502 for a success."""
    if is_json_media(content_type):
        return status, content
    media = content_type.split(";", 1)[0].strip() or "no content type"
    log.warning("upstream answered %s with %s, not JSON: replaced by the gateway's error", status, media)
    error = GatewayError(
        status if 400 <= status < 500 else 502,
        f"Upstream answered {status} with {media}, not JSON.",
        code="upstream_error",
    )
    return error.status, error.payload()


def error_response(error: GatewayError, *, request_id: str | None = None) -> HttpResponse:
    response = HttpResponse(error.payload(), status=error.status, content_type="application/json")
    if error.retry_after is not None:
        # Whole seconds, rounded up, at least 1 (the header has no fractions).
        response["Retry-After"] = str(max(1, int(-(-error.retry_after // 1))))
    if request_id:
        response["X-Request-Id"] = request_id
    return response


def error_event(error: GatewayError) -> bytes:
    """The one event sent when a stream fails after its first byte; the stream then closes."""
    return b"data: " + error.payload() + b"\n\n"
