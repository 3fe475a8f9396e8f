"""Step 4: may this caller make the request, and is there room (parsing is step 2, in parsing).

`admit` takes the team's and key's quotas in one Redis script, reserving the
prompt tokens plus the output cap of every sequence (prompts × n × max_tokens).
`place` then takes a slot per sequence (prompts × n) on a replica (least in flight under its
cap; long prompts under the long-prompt cap), waiting in the model's bounded
queue if none has room. A batch-class caller takes only spare capacity (below
GATEWAY_BATCH_SHARE of a replica's cap, never while an interactive request
waits), waiting in the model's batch queue for GATEWAY_BATCH_QUEUE_TIMEOUT_S.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import replace

from django.conf import settings
from redis.exceptions import RedisError

from portal.teams.models import UsageStatus

from ..config import gateway_settings
from ..errors import GatewayError, invalid_request, redis_required
from .limiter import RateLimiter
from .records import Admission, Scope, SlotGrant, prompt_limit

log = logging.getLogger("portal.gateway")

RETRY_MESSAGES = {
    "rpm": "requests per minute",
    "tpm": "tokens per minute",
    "tpd": "tokens per day",
    "concurrency": "concurrent requests",
}


def check_prompts_fit(
    prompts: int, caps: list[int | None], *, model: str, batch: bool, n: int = 1, best_of: int = 1
) -> None:
    """Every sequence of every prompt takes a replica slot, batch or interactive: a request with more
    of them than any replica of the model can take at once for its class is a 400 naming the field
    to lower (it could never be placed): `prompt` when the prompts alone do not fit, else `n` (or
    `best_of` when it is the larger)."""
    limit = prompt_limit(caps, gateway_settings().batch_share if batch else None)
    sequences = max(n, best_of)
    if limit is None or prompts * sequences <= limit:
        return
    share = " (the batch share of its concurrency cap: this key is in the batch class)" if batch else ""
    if prompts > limit:
        raise invalid_request(
            f"`prompt` holds {prompts} prompts; a replica of `{model}` runs at most {limit} of them at "
            f"once{share}. Send at most {limit} prompts per request.",
            "prompt",
        )
    field = "best_of" if best_of > n else "n"
    each = "" if prompts == 1 else f" for each of its {prompts} prompts"
    raise invalid_request(
        f"`{field}` asks for {sequences} sequences{each} ({prompts * sequences} in all), and each takes "
        f"a slot; a replica of `{model}` runs at most {limit} at once{share}. Lower `{field}` to at most "
        f"{limit // prompts}{' or send fewer prompts' if prompts > 1 else ''}.",
        field,
    )


def without_rpm(scope: Scope) -> Scope:
    """The scope with its requests-per-minute limit left out (already taken by `gate`)."""
    return replace(scope, limits=replace(scope.limits, rpm=None))


async def gate(limiter: RateLimiter, *, request_id: str, team: Scope, key: Scope) -> Admission:
    """The cheap checks alone (blocked key or team, requests per minute), taking the request's
    minute slot: run before an expensive prompt count, so a caller over its rate costs no counting."""
    cheap = [replace(s, limits=type(s.limits)(rpm=s.limits.rpm)) for s in (team, key)]
    return await limiter.admit(request_id=request_id, team=cheap[0], key=cheap[1], tokens=0)


async def admit_and_place(
    limiter: RateLimiter,
    *,
    request_id: str,
    team: Scope,
    key: Scope,
    tokens: int,
    model: str,
    candidates: list[tuple[int | str, int | None]],
    long_prompt: bool,
    on_admitted: Callable[[Admission], None],
    slots: int,
    batch: bool = False,
    open_record: str = "",
) -> tuple[Admission, SlotGrant | None]:
    """Quotas, then a replica slot: one Redis round trip when both say yes at once.
    `on_admitted` learns of the admission before the request waits in the queue."""
    with redis_required(request_id):
        try:
            return await limiter.admit_and_place(
                request_id=request_id,
                team=team,
                key=key,
                tokens=tokens,
                model=model,
                candidates=candidates,
                long_prompt=long_prompt,
                on_admitted=on_admitted,
                slots=slots,
                open_record=open_record,
                **_queue_limits(batch),
            )
        except RedisError:
            # The script may have run before the reply was lost (a timeout): give back what it took,
            # in the background, so the 503 is not held up by an ailing Redis.
            _in_background(
                lambda: limiter.give_back(
                    request_id=request_id, team=team, key=key, model=model, candidates=candidates, slots=slots
                ),
                f"give back what request {request_id} took",
            )
            raise


GIVE_BACK_ATTEMPTS = 5
_background: set[asyncio.Task] = set()


def _in_background(work: Callable[[], Awaitable[object]], what: str) -> None:
    """Run `work()` after the response, retrying a Redis error a few times a second apart (Redis may
    be coming back); the task is kept referenced until it ends."""

    async def attempts() -> None:
        for attempt in range(GIVE_BACK_ATTEMPTS):
            try:
                await work()
                return
            except RedisError as error:
                if attempt == GIVE_BACK_ATTEMPTS - 1:
                    log.warning("could not %s: %r (its slots lapse with their lease)", what, error)
                    return
                await asyncio.sleep(1)

    task = asyncio.get_running_loop().create_task(attempts())
    _background.add(task)
    task.add_done_callback(_background.discard)


def _queue_limits(batch: bool) -> dict:
    """The per-deployment limits every placement applies; a batch request's share of the cap and its
    own queue deadline."""
    config = gateway_settings()
    return config.batch_queue if batch else config.interactive_queue


def check_admission(admission: Admission) -> None:
    """Raise the 401/403/429 that a refused admission means."""
    if admission.ok:
        return
    reason = admission.reason
    if reason.endswith("_blocked"):
        raise GatewayError(
            401 if reason == "key_blocked" else 403,
            "This API key or its team is disabled.",
            code="key_disabled",
        )
    who, _, limit = reason.partition("_")
    if limit.endswith("too_large"):
        what = RETRY_MESSAGES[limit.removesuffix("_too_large")]
        raise GatewayError(
            429,
            f"This request needs {admission.tokens} tokens (prompt + max_tokens × n × prompts), more than "
            f"the {who}'s {what} "
            "quota; lower max_tokens.",
            code="tokens_exceed_quota",
        )
    raise GatewayError(
        429,
        f"Rate limit reached: the {who}'s {RETRY_MESSAGES.get(limit, limit)} quota.",
        code="rate_limit_exceeded",
        retry_after=admission.retry_after_s,
    )


async def check_daily_quota(
    limiter: RateLimiter,
    admission: Admission,
    *,
    team: Scope,
    key: Scope,
    prompt_tokens: int,
    sequences: int,
) -> None:
    """Raise the 429 of a request refused by a daily token quota, saying what it reserves, what is
    left today and the largest `max_tokens` that fits. `Retry-After` (the day's reset) only when no
    `max_tokens` fits: waiting cannot help otherwise, and 9.5 h of it misled a caller with ~330
    tokens left (issue 38). One more Redis read, on the refusal path only."""
    who = admission.reason.partition("_")[0]
    scope = team if who == "team" else key
    limit = scope.limits.tokens_per_day or 0
    left = max(0, limit - await limiter.tokens_used_on_day(scope, admission.day))
    fits = (left - prompt_tokens) // max(1, sequences)
    reserves = (
        f"This request reserves {admission.tokens} tokens (its prompt's {prompt_tokens} + max_tokens × n "
        f"× prompts); the {who}'s tokens per day quota has {left} of {limit} left today (UTC)."
    )
    if fits >= 1:
        raise GatewayError(
            429, f"{reserves} A max_tokens of at most {fits} fits.", code="tokens_per_day_exceeded"
        )
    raise GatewayError(
        429,
        f"{reserves} Not even its prompt fits: the quota resets at 00:00 UTC.",
        code="tokens_per_day_exceeded",
        retry_after=admission.retry_after_s,
    )


def check_slot_grant(grant: SlotGrant, model: str, *, batch: bool = False) -> int:
    """The index of the replica the request was placed on, or the 429/503 of a full or slow queue
    (a batch request's say it was the batch queue: its capacity is the spare share of the cap)."""
    if grant.index is not None:
        return grant.index
    if batch:
        if grant.reason == "queue_full":
            raise GatewayError(
                429,
                f"This key is in the batch class: `{model}` has no spare capacity for batch requests "
                "and its batch queue is full.",
                code="batch_queue_full",
                retry_after=5,
                usage_status=UsageStatus.UNAVAILABLE,
            )
        raise GatewayError(
            503,
            f"This key is in the batch class: `{model}` had no spare capacity for batch requests "
            f"for {settings.GATEWAY_BATCH_QUEUE_TIMEOUT_S:g} s.",
            code="batch_queue_timeout",
            retry_after=5,
        )
    if grant.reason == "queue_full":
        raise GatewayError(
            429,
            f"Every replica of `{model}` is at capacity and its queue is full.",
            code="queue_full",
            retry_after=1,
            usage_status=UsageStatus.UNAVAILABLE,  # capacity, not a quota of the caller's: an outage
        )
    raise GatewayError(
        503,
        f"Every replica of `{model}` stayed at capacity for {settings.GATEWAY_QUEUE_TIMEOUT_S:g} s.",
        code="queue_timeout",
        retry_after=1,
    )


async def place(
    limiter: RateLimiter,
    *,
    request_id: str,
    model: str,
    candidates: list[tuple[int | str, int | None]],
    long_prompt: bool,
    slots: int,
    batch: bool = False,
) -> SlotGrant:
    return await limiter.acquire_replica(
        request_id=request_id,
        model=model,
        candidates=candidates,
        long_prompt=long_prompt,
        slots=slots,
        **_queue_limits(batch),
    )
