"""The OpenAI-compatible proxy: `/v1/models`, `/v1/chat/completions`, `/v1/completions`.

One pipeline per request, each step in its own module:
the edge refuses a body over its limit (portal.core.bodylimit) → authenticate (auth)
→ parse (parsing) → route (routing) → admit quotas and place on a replica
(admission) → relay (upstream, sse) → account (usage). A Redis failure anywhere on
the way is one 503 (errors.redis_required).
Errors at any step are OpenAI-shaped (errors); every request that got past
authentication finishes its Exchange exactly once, which releases its slots.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time

from django.conf import settings
from django.http import HttpResponse, HttpResponseBase, JsonResponse
from django.views.decorators.csrf import csrf_exempt

from portal.core.errors import did_you_mean
from portal.core.jsonbody import TOO_DEEP
from portal.core.redis.client import async_gateway_redis, redis_keys
from portal.gateway.admission.leases import LeaseKeeper
from portal.gateway.admission.limiter import RateLimiter
from portal.gateway.admission.records import Scope, SlotGrant, slot_members
from portal.observability import prometheus
from portal.teams.models import UsageStatus

from . import timing
from .admission.steps import (
    admit_and_place,
    check_admission,
    check_daily_quota,
    check_prompts_fit,
    check_slot_grant,
    gate,
    place,
    without_rpm,
)
from .auth import Caller, authenticate, ensure_not_blocked, ensure_not_revoked, ensure_usable
from .config import gateway_settings
from .errors import GatewayError, body_too_large, error_response, redis_required, upstream_answer
from .parsing import ParsedRequest, parse
from .per_loop import PerLoop
from .routing import Replica, Route, route_for, served_models, smallest_context
from .sse import RelayResponse, RelayStream
from .tokens import prompt_count, prompt_count_off_loop
from .upstream import (
    UPSTREAM_ERRORS,
    ConnectTimeout,
    PoolTimeout,
    Read,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamResponse,
    UpstreamTooLarge,
    open_stream,
)
from .usage import Exchange, tokens_billed_on_day

log = logging.getLogger("portal.gateway")

# Upstream statuses that say the replica is misconfigured (its server key, its served model name),
# never the request: retried on another replica, and a 502 if none answers, never passed through.
MISCONFIGURED = frozenset({401, 403, 404})
# Bodies up to this size are counted on the event loop, at once: it costs less than parsing them did
# and less than the extra Redis round trip of checking the rate first. Larger ones are counted after
# the cheap limits, on the counting pool.
COUNT_INLINE_BYTES = 4096


def _new_limiter() -> tuple[RateLimiter, LeaseKeeper]:
    # The portal's one client factory: it fails fast when Redis is down or hung (a 503 within
    # one timeout), retries only refused or broken connections, and reconnects once Redis is back.
    limiter = RateLimiter(
        async_gateway_redis(),
        keys=redis_keys(),
        lease_ms=int(settings.GATEWAY_SLOT_LEASE_S * 1000),
        daily_used=tokens_billed_on_day,
    )
    return limiter, LeaseKeeper(limiter)


# One Redis client, limiter and lease keeper per event loop (uvicorn runs one).
_limiters: PerLoop[tuple[RateLimiter, LeaseKeeper]] = PerLoop(_new_limiter)


def _limiter() -> tuple[RateLimiter, LeaseKeeper]:
    return _limiters.get()


def _method_not_allowed(allowed: str) -> HttpResponse:
    response = error_response(GatewayError(405, f"Use {allowed}.", code="method_not_allowed"))
    response["Allow"] = allowed
    return response


@csrf_exempt
async def models(request):
    if request.method != "GET":
        return _method_not_allowed("GET")
    try:
        with redis_required():
            limiter = _limiter()[0]
            caller = await authenticate(request, limiter)
            ensure_usable(caller)
            await ensure_not_blocked(
                caller, limiter
            )  # revoked a moment ago: refused now, not in GATEWAY_CACHE_S
        if caller.models is None:
            names = await served_models(caller.team_id)
        else:  # a scoped key: its models that have a replica it may use (each route cached on its own)
            names = sorted([m for m in caller.models if (await route_for(m)).for_team(caller.team_id)])
    except GatewayError as error:
        return error_response(error)
    created = int(time.time())
    return JsonResponse(
        {
            "object": "list",
            "data": [{"id": m, "object": "model", "created": created, "owned_by": "portal"} for m in names],
        }
    )


@csrf_exempt
async def chat_completions(request):
    return await _proxy(request, chat=True)


@csrf_exempt
async def completions(request):
    return await _proxy(request, chat=False)


async def _proxy(request, *, chat: bool):
    if timing.ON:
        timing.lap("ASGI entry")
    if request.method != "POST":
        return _method_not_allowed("POST")
    limiter, keeper = _limiter()
    # Random ids without a getrandom() syscall per request (they are ids, not secrets).
    ex = Exchange(f"{random.getrandbits(128):032x}", "chat" if chat else "completions", limiter, keeper)
    try:
        ex.caller = await authenticate(request, limiter)
    except GatewayError as error:
        prometheus.unauthenticated(ex.endpoint, error)
        return error_response(error, request_id=ex.request_id)
    if timing.ON:
        timing.lap("authentication")
    return await _run(request, ex, chat=chat)


class _Body:
    """What `_serve` reads of a request, for a body the portal built itself (the playground)."""

    method = "POST"

    def __init__(self, body: bytes) -> None:
        self.body = body


async def proxy_as(caller: Caller, body: bytes, *, chat: bool = True) -> HttpResponseBase:
    """The pipeline after authentication, for a caller the portal authenticated itself: the
    playground, whose signed-in member stands for the team's playground key. Quotas, admission,
    routing, relay and accounting are those of any request with that key."""
    response, _ = await serve_as(caller, body, chat=chat)
    return response


async def serve_as(
    caller: Caller, body: bytes, *, chat: bool, request_id: str | None = None, record_usage: bool = True
) -> tuple[HttpResponseBase, Exchange]:
    """`proxy_as`, with the request's id and whether its usage record is queued chosen by the
    caller (a batch line: gateway/internal.py), and its finished exchange returned too."""
    limiter, keeper = _limiter()
    request_id = request_id or f"{random.getrandbits(128):032x}"
    ex = Exchange(request_id, "chat" if chat else "completions", limiter, keeper, record_usage=record_usage)
    ex.caller = caller
    return await _serve_as(ex, body, chat=chat), ex


async def _serve_as(ex: Exchange, body: bytes, *, chat: bool) -> HttpResponseBase:
    limit = gateway_settings().max_body_bytes
    if len(body) > limit:
        # Built by the portal, so the gateway's edge never saw it: the same 413, recorded as a refusal.
        error = body_too_large(limit)
        await ex.finish(error.usage_status, error.status, error.code)
        return error_response(error, request_id=ex.request_id)
    return await _run(_Body(body), ex, chat=chat)


async def _run(request, ex: Exchange, *, chat: bool) -> HttpResponseBase:
    """Serve an authenticated request; whatever happens, its exchange finishes once."""
    try:
        with redis_required(ex.request_id):  # no quota can be checked without Redis: no request
            return await _serve(request, ex, chat=chat)
    except GatewayError as error:
        await ex.finish(error.usage_status, error.status, error.code)
        return error_response(error, request_id=ex.request_id)
    except asyncio.CancelledError:
        # The client went away while queued or waiting for upstream: nothing reaches (or stays on) vLLM.
        await ex.finish(UsageStatus.CLIENT_CANCELLED, 499, "client_disconnected")
        raise
    except RecursionError:
        # A body nested deeper than a later step (counting, re-encoding) can follow: the client's
        # error, recorded as a refusal, never as an upstream error.
        too_deep = GatewayError(400, TOO_DEEP, code="invalid_json")
        await ex.finish(too_deep.usage_status, too_deep.status, too_deep.code)
        return error_response(too_deep, request_id=ex.request_id)
    except Exception:
        log.exception("gateway request %s failed", ex.request_id)
        await ex.finish(UsageStatus.UPSTREAM_ERROR, 500, "internal_error")
        return error_response(
            GatewayError(500, "Internal gateway error.", code="internal_error"), request_id=ex.request_id
        )


async def _serve(request, ex: Exchange, *, chat: bool) -> HttpResponseBase:
    """One request, top to bottom: parse, route, admit, relay (the edge checked its size)."""
    caller = ex.caller
    assert caller is not None  # authenticated before it is served
    ensure_usable(caller)
    raw = request.body
    parsed = parse(raw, chat=chat, caller=caller)
    ex.model, ex.stream = parsed.model, parsed.stream
    if timing.ON:
        timing.lap("parsing")
    route, replicas = await _route(parsed, caller)
    if timing.ON:
        timing.lap("route")
    placement, long_prompt = await _admit(ex, parsed, route, replicas, body_bytes=len(raw))
    return await _relay(ex, parsed, route, replicas, placement, long_prompt=long_prompt)


async def _route(parsed: ParsedRequest, caller: Caller) -> tuple[Route, tuple[Replica, ...]]:
    """The route of the request's model (a served name's drawn version) and the replicas this caller
    may use; a 404 for an unknown model, a 503 when none is serving for it."""
    route = await route_for(parsed.model)
    if not route.registered:
        # Suggest among what this key can reach only: other teams' models stay unnamed.
        reachable = caller.models if caller.models is not None else await served_models(caller.team_id)
        raise GatewayError(
            404,
            f"The model `{parsed.model}` does not exist.{did_you_mean(parsed.model, reachable)}",
            code="model_not_found",
            param="model",
        )
    if route.split:
        # A served name: this request's version, drawn by share; it goes upstream under the
        # version's name (what vLLM serves), and the answer names the version, as an alias does.
        route = route.pick(caller.team_id, pinned=caller.pinned_deployment_id)
        parsed.body["model"] = route.model
    replicas = route.for_team(caller.team_id)  # other teams' unshared replicas do not exist here
    if caller.pinned_deployment_id is not None:  # a member's benchmark measures its one deployment
        replicas = tuple(r for r in replicas if r.id == caller.pinned_deployment_id)
    if not replicas:
        raise GatewayError(
            503, f"No replica of `{parsed.model}` is serving.", code="no_replica", retry_after=5
        )
    check_prompts_fit(
        parsed.prompts,
        [r.cap for r in replicas],
        model=parsed.model,
        batch=caller.is_batch,
        n=parsed.n,
        best_of=parsed.best_of,
    )
    return route, replicas


async def _admit(
    ex: Exchange, parsed: ParsedRequest, route: Route, replicas: tuple[Replica, ...], *, body_bytes: int
) -> tuple[SlotGrant | None, bool]:
    """Count the prompt, take the quotas and (when there is room at once) a replica slot.
    Returns the placement (None: to be placed) and whether the prompt is long."""
    caller = ex.caller
    assert caller is not None  # authenticated before it is served
    ex.team = Scope("team", caller.team_id, caller.team_limits)
    ex.key = Scope("key", caller.key_id, caller.key_limits)
    if body_bytes <= COUNT_INLINE_BYTES:
        count = prompt_count(parsed.body, chat=parsed.chat, tokenizer_path=route.tokenizer_path)
    else:
        # Blocks and requests per minute first (taking the minute's slot), then the count, off the loop.
        gated = await gate(ex.limiter, request_id=ex.request_id, team=ex.team, key=ex.key)
        await ensure_not_revoked(gated.reason, caller, ex.limiter)
        check_admission(gated)
        ex.team, ex.key = without_rpm(ex.team), without_rpm(ex.key)
        count = await prompt_count_off_loop(
            parsed.body, chat=parsed.chat, tokenizer_path=route.tokenizer_path
        )
    ex.prompt_tokens = count.total
    ex.prompt_ceiling = max(count.total, body_bytes)
    if timing.ON:
        timing.lap("counting")
    parsed.bound_by_context(context_len=smallest_context(replicas), longest_prompt=count.longest)
    long_prompt = ex.prompt_tokens > gateway_settings().long_prompt_tokens
    # Written with the reservation: a process killed from then on leaves an `interrupted` record.
    open_record = ex.open_record(reserved_tokens=ex.prompt_tokens + parsed.reserved_output_tokens)
    ex.admission, placement = await admit_and_place(
        ex.limiter,
        request_id=ex.request_id,
        team=ex.team,
        key=ex.key,
        tokens=ex.prompt_tokens + parsed.reserved_output_tokens,
        model=route.model,
        candidates=[(r.id, r.cap) for r in replicas],
        long_prompt=long_prompt,
        on_admitted=ex.admitted,
        slots=parsed.slots,
        batch=caller.is_batch,
        open_record=open_record,
    )
    await ensure_not_revoked(ex.admission.reason, caller, ex.limiter)
    if ex.admission.reason.endswith("_tpd"):
        await check_daily_quota(
            ex.limiter,
            ex.admission,
            team=ex.team,
            key=ex.key,
            prompt_tokens=ex.prompt_tokens,
            sequences=parsed.slots,
        )
    check_admission(ex.admission)
    ex.completion_ceiling = parsed.reserved_output_tokens  # bound_by_context above: what was reserved
    if timing.ON:
        timing.lap("admission")
    return placement, long_prompt


async def _relay(
    ex: Exchange,
    parsed: ParsedRequest,
    route: Route,
    replicas: tuple[Replica, ...],
    placement: SlotGrant | None,
    *,
    long_prompt: bool,
) -> HttpResponseBase:
    """Send the request to its replica, and to another one while a replica fails before its first
    byte; then pass the answer on (streamed through `RelayStream`, or whole)."""
    assert ex.caller is not None  # authenticated before it is served
    batch = ex.caller.is_batch
    # Tiered first-token timeout (docs/v100-field-guide.md#gateway-rules: short 30 s, long 60 s).
    config = gateway_settings()
    first_token_timeout = config.first_token_timeout_long_s if long_prompt else config.first_token_timeout_s
    body = parsed.encode()
    if timing.ON:
        timing.lap("request encoding")
    remaining = list(replicas)
    failure: GatewayError | None = None
    while remaining:
        if placement is None:  # a retry after a replica failed before its first byte
            placement = await place(
                ex.limiter,
                request_id=ex.request_id,
                model=route.model,
                candidates=[(r.id, r.cap) for r in remaining],
                long_prompt=long_prompt,
                slots=parsed.slots,
                batch=batch,
            )
        replica = remaining.pop(check_slot_grant(placement, parsed.model, batch=batch))
        _occupy(ex, replica, placement)
        placement = None
        try:
            response, read, first = await _open(
                ex,
                replica,
                body,
                chat=parsed.chat,
                stream=parsed.stream,
                first_token_timeout=first_token_timeout,
            )
        except TimeoutError as exc:
            if not isinstance(exc, ConnectTimeout | PoolTimeout):
                raise GatewayError(
                    504,
                    "Upstream sent no first token in time.",
                    code="upstream_timeout",
                    usage_status=UsageStatus.TIMEOUT,
                ) from None
            failure = _unreachable(parsed.model)
            await _leave(ex, replica.id)
            continue
        except UPSTREAM_ERRORS as exc:
            # Retry on another replica only before the first byte.
            if isinstance(exc, UpstreamProtocolError | UpstreamTooLarge):
                failure = _refused(exc)
                log.warning("gateway request %s: replica %s: %s", ex.request_id, replica.name, exc)
            else:
                failure = _unreachable(parsed.model)
            await _leave(ex, replica.id)
            continue

        answer = await _answer(ex, parsed, replica, response, read, first, long_prompt=long_prompt)
        if isinstance(answer, GatewayError):  # this replica failed before any byte reached the client
            failure = answer
            await _leave(ex, replica.id)
            continue
        return answer
    raise failure or GatewayError(
        502, "No replica answered.", code="upstream_error", usage_status=UsageStatus.UPSTREAM_ERROR
    )


async def _answer(
    ex: Exchange,
    parsed: ParsedRequest,
    replica: Replica,
    response: UpstreamResponse,
    read: Read | None,
    first: bytes,
    *,
    long_prompt: bool,
) -> HttpResponseBase | GatewayError:
    """The client's response to upstream's answer, or the error of a replica that failed before
    its first byte (another replica may then be tried)."""
    status = response.status_code
    if status >= 500 or status in MISCONFIGURED:
        if status in MISCONFIGURED:
            # The gateway sends a served model name and the replica's own key: this replica is
            # misconfigured (wrong key or model), not the request. Another replica may serve it.
            log.warning(
                "gateway request %s: replica %s answered %s; trying another",
                ex.request_id,
                replica.name,
                status,
            )
        return GatewayError(
            502,
            f"Upstream answered {status}.",
            code="upstream_error",
            usage_status=UsageStatus.UPSTREAM_ERROR,
        )
    if status == 200 and parsed.stream and not first:
        # Closed before a single byte: nothing reached the client, so another replica may try.
        return _closed_empty()
    if status != 200:
        # Upstream refused the request itself (e.g. prompt over the context): its OpenAI error, as is.
        content = await _read(ex, response)
        await ex.finish(UsageStatus.REJECTED, status, f"upstream_{status}")
        return _passthrough(response, content, ex.request_id)
    if not parsed.stream:
        # No time to first token: the whole answer arrives at once, so such a request counts
        # toward end-to-end latency only, never toward TTFT and TPOT (docs/decisions.md).
        content = await _read(ex, response)
        if not content:
            return _closed_empty()
        _account_json(ex, content)
        await ex.finish(UsageStatus.COMPLETED, 200)
        return _passthrough(response, content, ex.request_id)
    assert read is not None  # a 200 stream: `_open` read its first chunk
    return await _stream_response(ex, parsed, replica, response, read, first, long_prompt=long_prompt)


def _occupy(ex: Exchange, replica: Replica, placement: SlotGrant) -> None:
    """The request now holds `placement`'s slots on `replica`: renewed until it leaves or finishes."""
    ex.placed = True
    ex.deployment_id, ex.replica_slots = replica.id, placement.slots
    ex.tried_deployment_id = replica.id
    ex.replica_name = replica.name
    ex.hold([ex.limiter.inflight_key(replica.id)], slot_members(ex.request_id, ex.replica_slots))
    ex.hold([ex.limiter.long_key(replica.id)])


async def _open(
    ex: Exchange, replica: Replica, body: bytes, *, chat: bool, stream: bool, first_token_timeout: float
) -> tuple[UpstreamResponse, Read | None, bytes]:
    """The one upstream call: (the response, the reader of its body past the first chunk, the first chunk).
    A stream's status and first chunk must come within the first-token timeout; a whole answer's
    status within the client's timeouts (upstream.py)."""
    # A whole answer's head comes with its end: both within GATEWAY_ANSWER_TIMEOUT_S (`_read`).
    ex.answer_deadline = asyncio.get_running_loop().time() + settings.GATEWAY_ANSWER_TIMEOUT_S
    async with asyncio.timeout(first_token_timeout if stream else settings.GATEWAY_ANSWER_TIMEOUT_S):
        url = replica.chat_url if chat else replica.completions_url
        ex.upstream = response = await open_stream(url, body, ex.request_id, replica.api_key)
        if timing.ON:
            timing.lap("upstream connect")
        if not stream or response.status_code != 200:
            return response, None, b""
        read = response.read
        first = await read()
        if timing.ON:
            timing.lap("first byte (upstream's own time included)")
        return response, read, first


async def _stream_response(
    ex: Exchange,
    parsed: ParsedRequest,
    replica: Replica,
    response: UpstreamResponse,
    read: Read,
    first: bytes,
    *,
    long_prompt: bool,
) -> HttpResponseBase:
    """The streamed answer, from its first chunk on; the exchange finishes when the stream ends."""
    ex.mark_first_byte()
    if long_prompt:
        # The limiter bounds long prompts in prefill (docs/v100-field-guide.md#gateway-rules), not for
        # their whole stream: the first byte means the first token, so prefill is over.
        await ex.let_go([ex.limiter.long_key(replica.id)])
        await ex.limiter.release_long(request_id=ex.request_id, deployment_id=replica.id)
    stream = RelayStream(ex, read, first, strip_usage=not parsed.client_wants_usage)
    out = RelayResponse(stream, content_type=response.headers.get("content-type", "text/event-stream"))
    out["Cache-Control"] = "no-cache"
    out["X-Accel-Buffering"] = "no"
    out["X-Request-Id"] = ex.request_id
    return out


async def _read(ex: Exchange, response: UpstreamResponse) -> bytes:
    """A whole answer, at most GATEWAY_UPSTREAM_MAX_ANSWER_BYTES, by the exchange's answer deadline."""
    try:
        async with asyncio.timeout_at(ex.answer_deadline):
            return await response.aread(settings.GATEWAY_UPSTREAM_MAX_ANSWER_BYTES)
    except UpstreamTooLarge as exc:
        raise _refused(exc) from None
    except TimeoutError:
        raise GatewayError(
            504, "Upstream did not finish in time.", code="upstream_timeout", usage_status=UsageStatus.TIMEOUT
        ) from None
    except UPSTREAM_ERRORS:
        raise GatewayError(
            502,
            "Upstream failed while answering.",
            code="upstream_error",
            usage_status=UsageStatus.UPSTREAM_ERROR,
        ) from None


async def _leave(ex: Exchange, deployment_id: int) -> None:
    if ex.upstream is not None:
        await ex.upstream.aclose()
        ex.upstream = None
    # No longer renewed (a renewal would put back the slots of a replica it has left).
    await ex.let_go([ex.limiter.inflight_key(deployment_id)], slot_members(ex.request_id, ex.replica_slots))
    await ex.let_go([ex.limiter.long_key(deployment_id)])
    await ex.limiter.release_replica(
        request_id=ex.request_id, deployment_id=deployment_id, slots=ex.replica_slots
    )
    ex.deployment_id, ex.replica_slots = None, 1


def _account_json(ex: Exchange, content: bytes) -> None:
    try:
        usage = json.loads(content).get("usage")
    except (ValueError, AttributeError, RecursionError):
        return
    ex.bill_upstream(usage)  # bounded: the upstream's numbers are not trusted


def _passthrough(response: UpstreamResponse, content: bytes, request_id: str) -> HttpResponse:
    """A whole upstream answer, passed on only as JSON (errors.upstream_answer)."""
    status, content = upstream_answer(
        response.status_code, content, response.headers.get("content-type", "application/json")
    )
    out = HttpResponse(content, status=status, content_type="application/json")
    out["X-Request-Id"] = request_id
    return out


def _closed_empty() -> GatewayError:
    return GatewayError(
        502,
        "Upstream closed without an answer.",
        code="upstream_error",
        usage_status=UsageStatus.UPSTREAM_ERROR,
    )


def _refused(exc: UpstreamError) -> GatewayError:
    """A replica whose answer the gateway will not relay (over a cap, a protocol switch)."""
    return GatewayError(
        502,
        f"Upstream's answer was refused: {exc}.",
        code=exc.code,
        usage_status=UsageStatus.UPSTREAM_ERROR,
    )


def _unreachable(model: str) -> GatewayError:
    return GatewayError(
        502,
        f"Could not reach a replica of `{model}`.",
        code="upstream_unreachable",
        usage_status=UsageStatus.UPSTREAM_ERROR,
    )
