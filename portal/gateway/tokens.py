"""Counting prompt tokens for the long-prompt limiter and the token reservation.

With the model's own tokenizer (`<model_version.path>/tokenizer.json`, loaded once
per path) when the gateway can read it; otherwise an estimate of one token per 4
characters (the usual ratio for English BPE vocabularies), which is what the
reservation is then corrected from.
"""

from __future__ import annotations

from functools import lru_cache

from tokenizers import Tokenizer

CHARS_PER_TOKEN = 4
MESSAGE_OVERHEAD_TOKENS = 4  # role and separators of a chat template, per message


@lru_cache(maxsize=32)
def _tokenizer(path: str) -> Tokenizer | None:
    try:
        return Tokenizer.from_file(path)
    except Exception:  # unreadable or not a tokenizers file: fall back to the estimate
        return None


def _count(text: str, tokenizer_path: str | None) -> int:
    if not text:
        return 0
    tokenizer = _tokenizer(tokenizer_path) if tokenizer_path else None
    if tokenizer is None:
        return -(-len(text) // CHARS_PER_TOKEN)
    return len(tokenizer.encode(text, add_special_tokens=False).ids)


def _text_of(content) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: [{"type": "text", "text": ...}, ...]
        return "".join(
            p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
        )
    return ""


def prompt_tokens(body: dict, *, chat: bool, tokenizer_path: str | None) -> int:
    if chat:
        messages = body.get("messages") or []
        text = "\n".join(_text_of(m.get("content")) for m in messages if isinstance(m, dict))
        return _count(text, tokenizer_path) + MESSAGE_OVERHEAD_TOKENS * len(messages)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return _count(prompt, tokenizer_path)
    if isinstance(prompt, list):
        if all(isinstance(p, int) for p in prompt):  # one prompt as token ids
            return len(prompt)
        return sum(len(p) if isinstance(p, list) else _count(str(p), tokenizer_path) for p in prompt)
    return 0
