"""Step 2 and 4: is the request well formed, may this caller make it, and is there room.

`parse` validates the body (never trusting it: any bad field is a 400 naming it),
clamps `max_tokens` to the team's clamp, and asks upstream for the usage chunk;
once the prompt is counted, `Parsed.bound_by_context` keeps `max_tokens` within
what the model's context leaves after it.
`admit` takes the team's and key's quotas in one Redis script, reserving the
prompt tokens plus the output cap of every sequence (prompts × n × max_tokens).
`place` then takes a slot per prompt on a replica (least in flight under its
cap; long prompts under the long-prompt cap), waiting in the model's bounded
queue if none has room. A batch-class caller takes only spare capacity (below
GATEWAY_BATCH_SHARE of a replica's cap, never while an interactive request
waits), waiting in the model's batch queue for GATEWAY_BATCH_QUEUE_TIMEOUT_S.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace

from django.conf import settings
from redis.exceptions import RedisError

from portal.core.errors import did_you_mean
from portal.core.jsonbody import TOO_DEEP
from portal.core.middleware import bad_text
from portal.core.redis.ratelimit import Admission, RateLimiter, Scope, SlotGrant, prompt_limit

from .errors import GatewayError

log = logging.getLogger("portal.gateway")

COMMON_FIELDS = {
    "model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "n", "stop",
    "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "user", "seed",
    # vLLM's sampling extras
    "top_k", "min_p", "repetition_penalty", "ignore_eos", "min_tokens", "stop_token_ids",
    "skip_special_tokens", "spaces_between_special_tokens", "truncate_prompt_tokens",
    "include_stop_str_in_output", "best_of", "use_beam_search", "length_penalty",
    "prompt_logprobs", "detokenize", "priority", "request_id", "guided_json", "guided_regex",
    "guided_choice", "guided_grammar", "structured_outputs", "response_format", "service_tier",
}  # fmt: skip
CHAT_FIELDS = COMMON_FIELDS | {
    "messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls",
    "functions", "function_call", "chat_template", "chat_template_kwargs", "add_generation_prompt",
    "continue_final_message", "echo", "documents", "reasoning_effort", "metadata", "store",
    "modalities", "audio", "prediction", "web_search_options", "add_special_tokens",
}  # fmt: skip
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "echo", "suffix", "add_special_tokens"}
MAX_N = 16
# A JSON escape of a UTF-16 surrogate: the only way a lone one (which no encoder takes) gets in.
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _bad(message: str, param: str, code: str = "invalid_value") -> GatewayError:
    return GatewayError(400, message, code=code, param=param)


def _is_token_ids(value) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )


def _prompt_count(prompt) -> int:
    """How many prompts a completion request carries (vLLM runs each as its own request)."""
    if isinstance(prompt, str) and prompt:
        return 1
    if _is_token_ids(prompt):  # one prompt as token ids
        return 1
    if (
        isinstance(prompt, list)
        and prompt
        and all((isinstance(p, str) and p) or _is_token_ids(p) for p in prompt)
    ):
        return len(prompt)
    raise _bad(
        "`prompt` must be a non-empty string, a list of token ids, or a list of those.",
        "prompt",
        "missing_parameter" if not prompt else "invalid_value",
    )


def _positive_int(body: dict, name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(f"`{name}` must be an integer.", name)
    if value < 1:
        raise _bad(f"`{name}` must be at least 1.", name)
    return value


@dataclass
class Parsed:
    body: dict
    model: str
    stream: bool
    client_wants_usage: bool
    max_tokens: int
    n: int
    chat: bool
    prompts: int = 1  # a completion's batch of prompts; each is a request of its own to vLLM
    # The body's fields that carry the output bound (max_tokens, and max_completion_tokens if sent).
    max_tokens_fields: tuple[str, ...] = ("max_tokens",)

    @property
    def reserved_output_tokens(self) -> int:
        """The most output tokens the request can produce: every sequence of every prompt."""
        return self.prompts * self.n * self.max_tokens

    def encode(self) -> bytes:
        return json.dumps(self.body, separators=(",", ":")).encode()

    def bound_by_context(self, *, context_len: int | None, longest_prompt: int) -> None:
        """Bound the output by what the replicas' context leaves after the longest prompt
        (docs/decisions.md, "max_tokens within the model's context"): a request without
        max_tokens, which parse gave the team's clamp, must not be refused by vLLM for a
        clamp larger than the context, and its reservation counts only what it can produce.
        An explicit max_tokens over the room is lowered the same way. At least 1: a prompt
        that fills the context is vLLM's to refuse, with its own message."""
        if context_len is None:
            return
        room = max(1, context_len - longest_prompt)
        if self.max_tokens <= room:
            return
        self.max_tokens = room
        for name in self.max_tokens_fields:
            self.body[name] = min(self.body[name], room)


def parse(raw: bytes, *, chat: bool, caller) -> Parsed:
    try:
        return _parse(raw, chat=chat, caller=caller)
    except RecursionError:  # parsed or walked: nesting too deep is the client's error, not ours
        raise GatewayError(400, TOO_DEEP, code="invalid_json") from None


def _parse(raw: bytes, *, chat: bool, caller) -> Parsed:
    if len(raw) > settings.GATEWAY_MAX_BODY_BYTES:
        raise GatewayError(
            413, f"Request body is over {settings.GATEWAY_MAX_BODY_BYTES} bytes.", code="request_too_large"
        )
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise GatewayError(400, "The body is not valid JSON.", code="invalid_json") from None
    if not isinstance(body, dict):
        raise GatewayError(400, "The body must be a JSON object.", code="invalid_json")
    unknown = sorted(set(body) - (CHAT_FIELDS if chat else COMPLETION_FIELDS))
    if unknown:
        raise _bad(f"Unrecognized request argument supplied: {unknown[0]}", unknown[0], "unknown_parameter")
    if SURROGATE_ESCAPE.search(raw):  # rare: only then walk the body
        for name, value in body.items():
            if bad_text(value, allow_nul=True):  # a lone surrogate cannot become UTF-8 upstream
                raise _bad(f"`{name}` contains a lone surrogate (\\ud800-\\udfff), which is not text.", name)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("`model` is required (a string).", "model", "missing_parameter")
    if bad_text(model):  # it is looked up and recorded in usage: PostgreSQL text must hold it
        raise _bad("`model` contains a NUL character or a lone surrogate.", "model")
    if caller.models is not None and model not in caller.models:
        raise GatewayError(
            403,
            f"This key may not use the model `{model}`.{did_you_mean(model, caller.models)}",
            code="model_not_allowed",
            param="model",
        )
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise _bad("`messages` must be a non-empty list of message objects.", "messages")
    prompts = 1
    if not chat:
        prompt = body.get("prompt")
        if prompt is None or prompt in ("", []):
            raise _bad("`prompt` is required (a string or a list).", "prompt", "missing_parameter")
        prompts = _prompt_count(prompt)
        if prompts > settings.GATEWAY_MAX_PROMPTS:
            raise _bad(
                f"`prompt` holds {prompts} prompts; at most {settings.GATEWAY_MAX_PROMPTS} per request.",
                "prompt",
            )
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad("`stream` must be true or false.", "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise _bad("`stream_options` must be an object.", "stream_options")
    n = _positive_int(body, "n") or 1
    if n > MAX_N:
        raise _bad(f"`n` must be at most {MAX_N}.", "n")

    # docs/v100-field-guide.md#gateway-rules: clamp max_tokens so a few long generations
    # cannot hold batch slots.
    name = "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
    asked = _positive_int(body, name)
    max_tokens = min(asked or caller.max_tokens_clamp, caller.max_tokens_clamp)
    body[name] = max_tokens
    if name == "max_completion_tokens" and "max_tokens" in body:
        # Both sent: the other is checked and clamped too, never passed upstream as it came.
        body["max_tokens"] = min(_positive_int(body, "max_tokens") or max_tokens, caller.max_tokens_clamp)

    fields = (name, "max_tokens") if name == "max_completion_tokens" and "max_tokens" in body else (name,)
    wants_usage = bool(stream and options and options.get("include_usage"))
    if stream:
        # Upstream's final usage chunk is how tokens are accounted; stripped again if not asked for.
        body["stream_options"] = {**(options or {}), "include_usage": True}
    return Parsed(body, model, stream, wants_usage, max_tokens, n, chat, prompts, fields)


RETRY_MESSAGES = {
    "rpm": "requests per minute",
    "tpm": "tokens per minute",
    "tpd": "tokens per day",
    "concurrency": "concurrent requests",
}


def check_prompts_fit(prompts: int, caps: list[int | None], *, model: str, batch: bool) -> None:
    """Every prompt takes a replica slot, batch or interactive: a request with more prompts than
    any replica of the model can take at once for its class is a 400 (it could never be placed)."""
    limit = prompt_limit(caps, settings.GATEWAY_BATCH_SHARE if batch else None)
    if limit is None or prompts <= limit:
        return
    share = " (the batch share of its concurrency cap: this key is in the batch class)" if batch else ""
    raise _bad(
        f"`prompt` holds {prompts} prompts; a replica of `{model}` runs at most {limit} of them at "
        f"once{share}. Send at most {limit} prompts per request.",
        "prompt",
    )


def limiter_unavailable() -> GatewayError:
    """Without Redis no quota or slot can be checked: refuse (never admit unlimited), retry soon."""
    return GatewayError(
        503,
        "The rate limiter is unavailable; retry shortly.",
        code="rate_limiter_unavailable",
        retry_after=2,
    )


def without_rpm(scope: Scope) -> Scope:
    """The scope with its requests-per-minute limit left out (already taken by `gate`)."""
    return replace(scope, limits=replace(scope.limits, rpm=None))


async def gate(limiter: RateLimiter, *, request_id: str, team: Scope, key: Scope) -> Admission:
    """The cheap checks alone (blocked key or team, requests per minute), taking the request's
    minute slot: run before an expensive prompt count, so a caller over its rate costs no counting."""
    cheap = [replace(s, limits=type(s.limits)(rpm=s.limits.rpm)) for s in (team, key)]
    try:
        return await limiter.admit(request_id=request_id, team=cheap[0], key=cheap[1], tokens=0)
    except RedisError:
        raise limiter_unavailable() from None


async def admit_and_place(
    limiter: RateLimiter,
    *,
    request_id: str,
    team: Scope,
    key: Scope,
    tokens: int,
    model: str,
    candidates: list[tuple[int, int | None]],
    long_prompt: bool,
    on_admitted: Callable[[Admission], None],
    slots: int,
    batch: bool = False,
) -> tuple[Admission, SlotGrant | None]:
    """Quotas, then a replica slot: one Redis round trip when both say yes at once.
    `on_admitted` learns of the admission before the request waits in the queue."""
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
        raise limiter_unavailable() from None


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
    """The per-deployment limits every placement applies (read per call: tests override settings);
    a batch request's share of the cap and its own queue deadline."""
    return {
        "long_cap": settings.GATEWAY_LONG_PROMPT_MAX_INFLIGHT,
        "queue_max": settings.GATEWAY_QUEUE_MAX,
        "timeout_s": settings.GATEWAY_BATCH_QUEUE_TIMEOUT_S if batch else settings.GATEWAY_QUEUE_TIMEOUT_S,
        "batch_share": settings.GATEWAY_BATCH_SHARE if batch else None,
        "interactive_timeout_s": settings.GATEWAY_QUEUE_TIMEOUT_S,
    }


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
    candidates: list[tuple[int, int | None]],
    long_prompt: bool,
    slots: int,
    batch: bool = False,
) -> SlotGrant:
    try:
        return await limiter.acquire_replica(
            request_id=request_id,
            model=model,
            candidates=candidates,
            long_prompt=long_prompt,
            slots=slots,
            **_queue_limits(batch),
        )
    except RedisError:
        raise limiter_unavailable() from None
