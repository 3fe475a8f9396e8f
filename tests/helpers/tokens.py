"""Tokenizers written for a test."""

from __future__ import annotations

from tokenizers import Tokenizer, models, pre_tokenizers


def word_tokenizer(path) -> str:
    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path))
    return str(path)
