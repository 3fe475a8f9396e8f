"""The gateway's in-process entries, for apps above it that serve OpenAI's API beside it (batches).

- `authenticate_api`: the key authentication of every `/v1/` route (auth), for other `/v1/` views.
- `forward`: one non-streamed request as a given key, through the same pipeline as an HTTP request
  (parse → route → admission → relay → account) in whatever event loop calls it (a batch worker's).
  The raw key is never needed (keys are stored hashed): the portal loads the key row itself and
  stands for it, as the playground does (`views.serve_as`).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from asgiref.sync import sync_to_async
from django.db import close_old_connections
from django.http import HttpResponse

from portal.teams.models import ApiKey, PriorityClass, UsageStatus
from portal.teams.usage_record import UsageRecord

from .auth import Caller, authenticate, caller_for_key, ensure_not_blocked, ensure_usable
from .errors import GatewayError, redis_required
from .views import _limiter, serve_as


async def authenticate_api(request) -> Caller:
    """The caller of a `/v1/` request, refused as the gateway's own routes refuse it (unknown,
    revoked, expired, over its daily budget, blocked in Redis); raises GatewayError."""
    with redis_required():
        limiter = _limiter()[0]
        caller = await authenticate(request, limiter)
        ensure_usable(caller)
        await ensure_not_blocked(caller, limiter)
    return caller


def _key_row(key_id: int) -> ApiKey | None:
    return ApiKey.objects.select_related("team").filter(pk=key_id).first()


def batch_caller_now(key_id: int) -> Caller | None:
    """The caller a batch line runs as: the key's own quotas, clamp, models and limits, always in
    the batch class (never above the batch share of a replica). None if the key is gone."""
    key = _key_row(key_id)
    if key is None:
        return None
    return dataclasses.replace(caller_for_key(key), priority_class=PriorityClass.BATCH)


async def batch_caller(key_id: int) -> Caller | None:
    """`batch_caller_now`, from an event loop."""

    def load() -> Caller | None:
        close_old_connections()  # a worker thread's connection, as the gateway's own loads do
        return batch_caller_now(key_id)

    return await sync_to_async(load)()


@dataclass(frozen=True)
class Forwarded:
    """What one forwarded request came to: the HTTP answer the client would have got, the usage
    record of its one exchange (not queued: the caller stores it), and the gateway's refusal code
    and Retry-After when the gateway answered itself."""

    status: int
    body: dict | None  # the JSON answer (the upstream's, or the gateway's error)
    usage: UsageRecord
    error_code: str
    retry_after_s: float | None

    @property
    def usage_status(self) -> UsageStatus:
        return self.usage.status


async def forward(caller: Caller, body: bytes, *, chat: bool, request_id: str) -> Forwarded:
    """Send one request (a non-streamed body) as `caller` under the id `request_id` (32 hex digits);
    no usage record is queued for it."""
    response, ex = await serve_as(caller, body, chat=chat, request_id=request_id, record_usage=False)
    # A batch line's body is never streamed (validation refuses `stream`); anything else is no answer.
    content = response.content if isinstance(response, HttpResponse) else b""
    try:
        answer = json.loads(content)
    except (ValueError, RecursionError):
        answer = None
    retry_after = response.get("Retry-After")
    return Forwarded(
        status=response.status_code,
        body=answer if isinstance(answer, dict) else None,
        usage=ex.usage_record(),
        error_code=ex.outcome[2] if ex.outcome else "",
        retry_after_s=float(retry_after) if retry_after else None,
    )


__all__ = [
    "Caller",
    "Forwarded",
    "GatewayError",
    "authenticate_api",
    "batch_caller",
    "batch_caller_now",
    "forward",
]
