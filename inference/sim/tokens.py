"""Prompt tokens and output text for the simulator.

With the model's `tokenizer.json` at hand (a model directory), prompts are
counted with it exactly as vLLM would. Without one (a bare config.json or a
bundled config name), a prompt is cut into pieces of four characters, one token
each: about OpenAI's rule of thumb for English, and the estimate the benchmark's
prompt builder uses without a tokenizer. Equal text gives equal token ids, so
prompts that share a prefix share prefix-cache blocks either way.
"""

from __future__ import annotations

import zlib
from pathlib import Path

CHARS_PER_TOKEN = 4

# The simulated model's vocabulary: plain words, so streamed text reads as text.
_WORDS = (
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "that",
    "for",
    "it",
    "as",
    "was",
    "with",
    "be",
    "by",
    "on",
    "not",
    "he",
    "this",
    "are",
    "or",
    "his",
    "from",
    "at",
    "which",
    "but",
    "have",
    "an",
    "they",
    "you",
    "were",
    "her",
    "one",
    "all",
    "we",
    "can",
    "has",
    "there",
    "been",
    "if",
    "more",
    "when",
    "will",
    "would",
    "who",
    "so",
    "no",
    "she",
    "other",
    "its",
    "may",
    "these",
    "about",
    "than",
    "some",
    "time",
    "into",
    "only",
    "do",
    "could",
    "new",
    "then",
    "any",
    "what",
    "most",
)


class Tokenizer:
    def __init__(self, tokenizer_json: Path | None = None) -> None:
        self._tokenizer = None
        if tokenizer_json is not None and tokenizer_json.is_file():
            from tokenizers import Tokenizer as HfTokenizer

            self._tokenizer = HfTokenizer.from_file(str(tokenizer_json))

    @property
    def exact(self) -> bool:
        return self._tokenizer is not None

    def encode(self, text: str) -> list[int]:
        if self._tokenizer is not None:
            return self._tokenizer.encode(text, add_special_tokens=True).ids
        return [
            zlib.crc32(text[i : i + CHARS_PER_TOKEN].encode()) for i in range(0, len(text), CHARS_PER_TOKEN)
        ]


def output_text(request_seed: int, index: int) -> str:
    """The text of output token `index` of a request: one word with its leading space."""
    return " " + _WORDS[(request_seed + index * 7) % len(_WORDS)]


def natural_length(request_seed: int, max_tokens: int, min_tokens: int) -> int | None:
    """Where the simulated model would emit EOS (16-256 tokens, deterministic per request,
    never before `min_tokens`), or None when `max_tokens` comes first."""
    length = max(min_tokens, 16 + (request_seed * 2654435761 >> 7) % 241)
    return length if length < max_tokens else None
