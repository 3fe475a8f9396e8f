"""Prompts of real text built to an exact token count with the deployment's own tokenizer.

The count is what the server will report as `usage.prompt_tokens` for
`/v1/completions`: the tokenizer's special tokens (a Llama BOS) included. Text
is English sentences drawn from a small built-in corpus, seeded; a prompt is
cut at a token boundary, decoded, and re-encoded until the count is exact
(re-encoding a cut can merge or split a token, so it is checked, never assumed).

Without a tokenizer, `EstimatingPromptBuilder` uses a stated estimate (about
4 characters of English per token, OpenAI's rule of thumb): the prompt is
then only approximately the requested length, and the run records so. The
server's `usage` still gives the true counts that the metrics use.
"""

from __future__ import annotations

import random
from pathlib import Path

from inference.errors import InputError
from inference.loadgen.workloads import RequestSpec

CHARS_PER_TOKEN_ESTIMATE = 4.0

_CORPUS = """\
The node agent starts the engine and watches it until it reports healthy.
Every request that arrives at the gateway is checked against the team's quota first.
Memory bandwidth decides how fast a large model can produce the next token.
A benchmark that hides its failures is worse than no benchmark at all.
The operators tune each deployment for weeks before they trust its numbers.
Long documents are summarised at night when the cluster is quiet.
Short questions should not wait behind a prompt of several thousand tokens.
The cache holds the keys and values of every sequence that is still running.
When the cache is full the scheduler preempts a sequence and recomputes it later.
Tensor parallelism splits every layer across the cards of one group.
A cheap link between the cards makes every decode step pay for the all-reduce.
The river ran past the old mill where the farmers brought their grain each autumn.
She opened the window and listened to the rain falling on the quiet street.
Good measurements start with a clear question and end with an honest table.
The library kept its oldest maps in a cold room under the main reading hall.
A small team can run a large service if the service explains its own failures.
The weather changed twice before noon, and the hikers turned back at the ridge.
Numbers that cannot be reconciled with each other point to a measurement bug.
The train left the station on time and crossed the valley under a grey sky.
Each user in the closed loop sends the next request when the last one ends.
""".splitlines()


def _text(rng: random.Random, approx_chars: int) -> str:
    sentences: list[str] = []
    size = 0
    while size < approx_chars:
        sentence = rng.choice(_CORPUS)
        sentences.append(sentence)
        size += len(sentence) + 1
    return " ".join(sentences)


class PromptBuilder:
    """Builds prompts of an exact token count with a `tokenizers` tokenizer.json."""

    exact = True

    def __init__(self, tokenizer_path: str | Path) -> None:
        from tokenizers import Tokenizer  # imported here: the estimate fallback needs no tokenizer library

        path = Path(tokenizer_path)
        if path.is_dir():
            path = path / "tokenizer.json"
        try:
            self.tokenizer = Tokenizer.from_file(str(path))
        except Exception as error:  # tokenizers raises a bare Exception for every failure
            raise InputError("tokenizer", f"cannot load tokenizer {path}: {error}") from error
        self.source = str(path)
        self.special_tokens = len(self.tokenizer.encode("", add_special_tokens=True).ids)
        self._documents: dict[int, str] = {}

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=True).ids)

    def _fit(self, text: str, target: int, prefix: str = "") -> str:
        """The longest start of `text` such that prefix + it has exactly `target` tokens."""
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        budget = target - self.count(prefix) if prefix else target - self.special_tokens
        if budget <= 0:
            raise InputError("prompt_tokens", f"{target} tokens is too short for this prompt's fixed part")
        if len(ids) < budget:
            raise InputError("prompt_tokens", f"not enough text for {target} tokens")
        cut = budget
        for _ in range(64):
            candidate = self.tokenizer.decode(ids[:cut])
            have = self.count(prefix + candidate)
            if have == target:
                return candidate
            cut += target - have
            if cut <= 0 or cut > len(ids):
                break
        # Re-tokenization oscillates at this boundary: pad a word-by-word fallback.
        candidate = self.tokenizer.decode(ids[: max(1, budget - 4)])
        while self.count(prefix + candidate) < target:
            candidate += " a"
        if self.count(prefix + candidate) != target:
            raise InputError("prompt_tokens", f"cannot build a prompt of exactly {target} tokens")
        return candidate

    def document(self, group: int, tokens: int) -> str:
        """The shared document of a prefix group: the same text for every request of the group."""
        key = group * 1_000_003 + tokens
        if key not in self._documents:
            rng = random.Random(f"document-{group}")  # noqa: S311 (reproducible text, not security)
            self._documents[key] = self._fit(_text(rng, tokens * 8), tokens)
        return self._documents[key]

    def build(self, spec: RequestSpec, *, seed: int) -> str:
        rng = random.Random(seed)  # noqa: S311 (reproducible text, not security)
        if spec.prefix_group is not None and spec.shared_prefix_tokens:
            prefix = self.document(spec.prefix_group, spec.shared_prefix_tokens) + "\n\nQuestion: "
            question_tokens = spec.prompt_tokens - spec.shared_prefix_tokens
            return prefix + self._fit(_text(rng, question_tokens * 8 + 200), spec.prompt_tokens, prefix)
        return self._fit(_text(rng, spec.prompt_tokens * 8), spec.prompt_tokens)


class EstimatingPromptBuilder:
    """The fallback when no tokenizer is available: ~4 characters of English per token (an estimate)."""

    exact = False

    def __init__(self, chars_per_token: float = CHARS_PER_TOKEN_ESTIMATE) -> None:
        # The load generator rescales this from the server's count for one probe prompt.
        self.chars_per_token = chars_per_token

    @property
    def source(self) -> str:
        return f"estimate: {self.chars_per_token:.2f} characters per token (no tokenizer)"

    def build(self, spec: RequestSpec, *, seed: int) -> str:
        rng = random.Random(seed)  # noqa: S311 (reproducible text, not security)
        chars = int(spec.prompt_tokens * self.chars_per_token)
        if spec.prefix_group is not None and spec.shared_prefix_tokens:
            doc_chars = int(spec.shared_prefix_tokens * self.chars_per_token)
            document = _text(random.Random(f"document-{spec.prefix_group}"), doc_chars)[:doc_chars]  # noqa: S311
            return document + "\n\nQuestion: " + _text(rng, chars - doc_chars)[: max(1, chars - doc_chars)]
        return _text(rng, chars)[:chars]


def prompt_builder(tokenizer_path: str | Path | None) -> PromptBuilder | EstimatingPromptBuilder:
    """A tokenizer-exact builder when a path is given (InputError if it cannot load), else the estimate."""
    if tokenizer_path:
        return PromptBuilder(tokenizer_path)
    return EstimatingPromptBuilder()
