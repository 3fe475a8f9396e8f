"""Counting prompt tokens for the long-prompt limiter and the token reservation.

With the model's own tokenizer (`<model_version.path>/tokenizer.json`, loaded once
per path) when the gateway can read it; otherwise an estimate of one token per 4
characters (the usual ratio for English BPE vocabularies), which is what the
reservation is then corrected from.

Everything that becomes prompt text counts, not only the messages' text: tool and
function definitions, RAG `documents`, tool calls and other message fields, a custom
chat template and its arguments (as the JSON they are sent as), and a completion's
`suffix`. Non-text content parts (images, audio, files) count by the size of their
JSON at 4 characters per token: an over-estimate that the reservation corrects, and
never a free pass for a large body.
"""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache

from tokenizers import Tokenizer

CHARS_PER_TOKEN = 4
MESSAGE_OVERHEAD_TOKENS = 4  # role and separators of a chat template, per message
# Top-level chat fields that a chat template renders into the prompt.
CHAT_PROMPT_FIELDS = ("tools", "functions", "documents", "chat_template", "chat_template_kwargs")

# Large prompts are counted here, off the event loop; two workers bound the CPU that counting can
# take from streaming, and further counts wait their turn.
_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="prompt-count")


@lru_cache(maxsize=32)
def _tokenizer(path: str) -> Tokenizer | None:
    try:
        return Tokenizer.from_file(path)
    except Exception:  # unreadable or not a tokenizers file: fall back to the estimate
        return None


def _estimate(chars: int) -> int:
    return -(-chars // CHARS_PER_TOKEN)


def _count(text: str, tokenizer_path: str | None) -> int:
    if not text:
        return 0
    tokenizer = _tokenizer(tokenizer_path) if tokenizer_path else None
    if tokenizer is None:
        return _estimate(len(text))
    try:
        return len(tokenizer.encode(text, add_special_tokens=False).ids)
    except Exception:  # text it cannot take (parse refuses lone surrogates first): estimate, not a 500
        return _estimate(len(text))


def _json(value) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _message_parts(message: dict, texts: list[str]) -> int:
    """Add the message's prompt text to `texts`; return the estimated tokens of its non-text parts."""
    other = 0
    content = message.get("content")
    if isinstance(content, str):
        texts.append(content)
    elif isinstance(content, list):  # content parts: [{"type": "text", "text": ...}, {"type": "image_url"…}]
        for part in content:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                texts.append(part["text"])
            elif part is not None:
                other += _estimate(len(_json(part)))
    elif content is not None:
        texts.append(_json(content))
    rest = {k: v for k, v in message.items() if k not in ("role", "content") and v is not None}
    if rest:  # tool_calls, name, tool_call_id, reasoning_content…: rendered by the template
        texts.append(_json(rest))
    return other


@dataclass(frozen=True)
class PromptCount:
    total: int  # every prompt of the request: what the reservation counts
    longest: int  # its longest prompt: what the context must hold beside the output


def prompt_count(body: dict, *, chat: bool, tokenizer_path: str | None) -> PromptCount:
    """Prompt tokens of a parsed request: every prompt of a batch, everything a template renders."""
    if chat:
        messages = body.get("messages") or []
        texts: list[str] = []
        other = 0
        for message in messages:
            if isinstance(message, dict):
                other += _message_parts(message, texts)
        for name in CHAT_PROMPT_FIELDS:
            value = body.get(name)
            if value is not None:
                texts.append(value if isinstance(value, str) else _json(value))
        total = _count("\n".join(texts), tokenizer_path) + other + MESSAGE_OVERHEAD_TOKENS * len(messages)
        return PromptCount(total, total)
    suffix = _count(body["suffix"], tokenizer_path) if isinstance(body.get("suffix"), str) else 0
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        counts = [_count(prompt, tokenizer_path)]
    elif isinstance(prompt, list) and all(isinstance(p, int) for p in prompt):  # one prompt as token ids
        counts = [len(prompt)]
    elif isinstance(prompt, list):
        counts = [len(p) if isinstance(p, list) else _count(str(p), tokenizer_path) for p in prompt]
    else:
        counts = []
    # The suffix is counted once in the total (as before), and beside every prompt in the longest.
    return PromptCount(suffix + sum(counts), suffix + max(counts, default=0))


def prompt_tokens(body: dict, *, chat: bool, tokenizer_path: str | None) -> int:
    """Prompt tokens of a parsed request: every prompt of a batch, everything a template renders."""
    return prompt_count(body, chat=chat, tokenizer_path=tokenizer_path).total


async def prompt_count_off_loop(body: dict, *, chat: bool, tokenizer_path: str | None) -> PromptCount:
    """`prompt_count` on the counting pool, leaving the event loop free for other requests."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(
        _pool, lambda: prompt_count(body, chat=chat, tokenizer_path=tokenizer_path)
    )
