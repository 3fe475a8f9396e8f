"""What the playground page may send, checked and turned into an OpenAI chat request.

The page sends `{model, messages, system, max_tokens, temperature}`; anything out of
bounds is a 400 in the gateway's error shape, naming the field, before the gateway
is asked. The request built here always streams.
"""

from __future__ import annotations

import json

from portal.gateway.errors import GatewayError

MAX_MESSAGES = 50
MAX_MODEL_CHARS = 100  # ModelVersion.name's length
MAX_MESSAGE_CHARS = 8_000
MAX_SYSTEM_CHARS = 4_000
MAX_TEMPERATURE = 2.0
ROLES = ("user", "assistant")
FIELDS = {"model", "messages", "system", "max_tokens", "temperature"}


def _bad(message: str, param: str) -> GatewayError:
    return GatewayError(400, message, code="invalid_value", param=param)


def chat_body(raw: bytes, *, max_tokens_clamp: int) -> bytes:
    """The OpenAI chat request for a playground post, or a GatewayError 400 naming the bad field.

    Whether the team may call the model, and whether it is serving, is the gateway's to say
    (403, 404 or 503 with its message), as for any key."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise GatewayError(400, "The body is not valid JSON.", code="invalid_json") from None
    if not isinstance(data, dict):
        raise GatewayError(400, "The body must be a JSON object.", code="invalid_json")
    unknown = sorted(set(data) - FIELDS)
    if unknown:
        raise _bad(f"Unknown field `{unknown[0]}`.", unknown[0])

    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("Pick a model.", "model")
    if len(model) > MAX_MODEL_CHARS:
        raise _bad(f"The model name is over {MAX_MODEL_CHARS} characters.", "model")

    messages = data.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("Write a message.", "messages")
    if len(messages) > MAX_MESSAGES:
        raise _bad(f"At most {MAX_MESSAGES} messages: clear the chat to go on.", "messages")
    for i, message in enumerate(messages):
        if (
            not isinstance(message, dict)
            or set(message) != {"role", "content"}
            or message["role"] not in ROLES
            or not isinstance(message["content"], str)
        ):
            raise _bad(f"Message {i + 1} must be {{role: user|assistant, content: text}}.", "messages")
        if len(message["content"]) > MAX_MESSAGE_CHARS:
            raise _bad(f"Message {i + 1} is over {MAX_MESSAGE_CHARS} characters.", "messages")
    if messages[-1]["role"] != "user" or not messages[-1]["content"].strip():
        raise _bad("The last message must be yours, and not empty.", "messages")

    system = data.get("system") or ""
    if not isinstance(system, str):
        raise _bad("The system prompt must be text.", "system")
    if len(system) > MAX_SYSTEM_CHARS:
        raise _bad(f"The system prompt is over {MAX_SYSTEM_CHARS} characters.", "system")

    max_tokens = data.get("max_tokens")
    if (
        isinstance(max_tokens, bool)
        or not isinstance(max_tokens, int)
        or not 1 <= max_tokens <= max_tokens_clamp
    ):
        message = f"max_tokens must be a whole number from 1 to {max_tokens_clamp} (the team's clamp)."
        raise _bad(message, "max_tokens")

    temperature = data.get("temperature")
    if (
        isinstance(temperature, bool)
        or not isinstance(temperature, int | float)
        or not 0 <= temperature <= MAX_TEMPERATURE
    ):
        raise _bad(f"temperature must be a number from 0 to {MAX_TEMPERATURE:g}.", "temperature")

    prefix = [{"role": "system", "content": system}] if system.strip() else []
    body = {
        "model": model,
        "messages": prefix + messages,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "stream": True,
        # The page shows the tokens the request was accounted for.
        "stream_options": {"include_usage": True},
    }
    return json.dumps(body, separators=(",", ":")).encode()
