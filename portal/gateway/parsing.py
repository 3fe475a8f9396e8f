"""Step 2: is the request well formed. Raw body → a `ParsedRequest`, or a 400/403 naming the field.

`parse` validates the body (never trusting it: any bad field is a 400 naming it),
clamps `max_tokens` to the team's clamp, and asks upstream for the usage chunk;
once the prompt is counted, `ParsedRequest.bound_by_context` keeps `max_tokens`
within what the model's context leaves after it. The body's size was checked at the
edge (portal.core.bodylimit), before it was read.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from django.conf import settings

from portal.core.errors import did_you_mean
from portal.core.jsonbody import TOO_DEEP
from portal.core.middleware import bad_text

from .errors import GatewayError, invalid_request

if TYPE_CHECKING:
    from .auth import Caller

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
    raise invalid_request(
        "`prompt` must be a non-empty string, a list of token ids, or a list of those.",
        "prompt",
        "missing_parameter" if not prompt else "invalid_value",
    )


def _positive_int(body: dict, name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid_request(f"`{name}` must be an integer.", name)
    if value < 1:
        raise invalid_request(f"`{name}` must be at least 1.", name)
    return value


@dataclass
class ParsedRequest:
    """A validated completion or chat request: its body (as it goes upstream, max_tokens clamped and
    the usage chunk asked for) and what the later steps read of it."""

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
    best_of: int = 1  # sequences generated per prompt when more than `n` (the best `n` are returned)

    @property
    def sequences_per_prompt(self) -> int:
        """The sequences the engine runs at once for each prompt: `n`, or `best_of` when larger."""
        return max(self.n, self.best_of)

    @property
    def slots(self) -> int:
        """The replica slots the request takes: one per sequence of every prompt (issue 35: 3
        prompts with n=16 are 48 sequences in the engine's batch, not 3)."""
        return self.prompts * self.sequences_per_prompt

    @property
    def reserved_output_tokens(self) -> int:
        """The most output tokens the request can produce: every sequence of every prompt."""
        return self.slots * self.max_tokens

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


def parse(raw: bytes, *, chat: bool, caller: Caller) -> ParsedRequest:
    try:
        return _parse(raw, chat=chat, caller=caller)
    except RecursionError:  # parsed or walked: nesting too deep is the client's error, not ours
        raise GatewayError(400, TOO_DEEP, code="invalid_json") from None


def _parse(raw: bytes, *, chat: bool, caller: Caller) -> ParsedRequest:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise GatewayError(400, "The body is not valid JSON.", code="invalid_json") from None
    if not isinstance(body, dict):
        raise GatewayError(400, "The body must be a JSON object.", code="invalid_json")
    unknown = sorted(set(body) - (CHAT_FIELDS if chat else COMPLETION_FIELDS))
    if unknown:
        raise invalid_request(
            f"Unrecognized request argument supplied: {unknown[0]}", unknown[0], "unknown_parameter"
        )
    if SURROGATE_ESCAPE.search(raw):  # rare: only then walk the body
        for name, value in body.items():
            if bad_text(value, allow_nul=True):  # a lone surrogate cannot become UTF-8 upstream
                raise invalid_request(
                    f"`{name}` contains a lone surrogate (\\ud800-\\udfff), which is not text.", name
                )
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid_request("`model` is required (a string).", "model", "missing_parameter")
    if bad_text(model):  # it is looked up and recorded in usage: PostgreSQL text must hold it
        raise invalid_request("`model` contains a NUL character or a lone surrogate.", "model")
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
            raise invalid_request("`messages` must be a non-empty list of message objects.", "messages")
    prompts = 1
    if not chat:
        prompt = body.get("prompt")
        if prompt is None or prompt in ("", []):
            raise invalid_request("`prompt` is required (a string or a list).", "prompt", "missing_parameter")
        prompts = _prompt_count(prompt)
        if prompts > settings.GATEWAY_MAX_PROMPTS:
            raise invalid_request(
                f"`prompt` holds {prompts} prompts; at most {settings.GATEWAY_MAX_PROMPTS} per request.",
                "prompt",
            )
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise invalid_request("`stream` must be true or false.", "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise invalid_request("`stream_options` must be an object.", "stream_options")
    n = _positive_int(body, "n") or 1
    if n > MAX_N:
        raise invalid_request(f"`n` must be at most {MAX_N}.", "n")
    best_of = _positive_int(body, "best_of") or n
    if best_of > MAX_N:
        raise invalid_request(f"`best_of` must be at most {MAX_N}.", "best_of")
    if best_of < n:
        raise invalid_request(f"`best_of` ({best_of}) must be at least `n` ({n}).", "best_of")

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
    return ParsedRequest(body, model, stream, wants_usage, max_tokens, n, chat, prompts, fields, best_of)
