"""The feature probe of a node acceptance run with a profile (`--profile`): does this node's vLLM
serve the features its table marks unsupported on Volta, with the profile's own flags?

vLLM's feature × hardware table marks chunked prefill (vllm#2729) and automatic prefix caching
(vllm#3687) unsupported on Volta: a prompt's later chunks, and a prompt whose prefix is cached,
run a Triton kernel that fails on sm_70. A deployment's smoke test never reaches either (its
prompts are short and new), so the probe asks for both on purpose: one prompt longer than the
token budget (it must be chunked) and one prompt twice (the second finds its prefix cached). It
passes when every answer is a 200 with tokens and the engine's /health still answers 200 after.

No Django here: the step in steps.py gives it the engine's address and the profile's numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import httpx

CHUNKED_PREFILL = "enable_chunked_prefill"
PREFIX_CACHING = "enable_prefix_caching"
# What the step's messages call each flag, and the vLLM issue behind its mark on Volta.
FEATURES = {
    CHUNKED_PREFILL: ("chunked prefill", "vllm#2729"),
    PREFIX_CACHING: ("prefix caching", "vllm#3687"),
}
MAX_TOKENS = 4  # a few sampled tokens: the engine decoded after the prefill it was asked for
FIRST_TOKEN_ID = 10  # past the special tokens every tokenizer puts first


@dataclass(frozen=True)
class ProbeTarget:
    """The serving engine and the numbers of the profile it runs."""

    base_url: str
    model: str
    api_key: str | None
    max_num_batched_tokens: int
    max_model_len: int
    block_size: int
    vocab_size: int
    timeout_s: float


@dataclass
class ProbeOutcome:
    """What the probe did (`lines`, one per request sent or probe skipped) and, when it failed, why."""

    lines: list[str] = field(default_factory=list)
    failure: str = ""  # "" when it passed


class ProbeFailed(Exception):
    pass


def feature_label(flag: str) -> str:
    name, issue = FEATURES[flag]
    return f"{name} ({issue})"


def _prompt(length: int, *, offset: int, vocab_size: int) -> list[int]:
    """`length` token ids; prompts of different offsets share no first block (no cached prefix)."""
    span = max(2, vocab_size - FIRST_TOKEN_ID)
    return [FIRST_TOKEN_ID + (offset + i) % span for i in range(length)]


def _complete(client: httpx.Client, target: ProbeTarget, prompt: list[int], what: str) -> int:
    """Send one prompt (as token ids: its length is exact); the tokens it answered, or ProbeFailed."""
    body = {
        "model": target.model,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "temperature": 0.0,
    }
    try:
        response = client.post(f"{target.base_url}/v1/completions", json=body)
    except httpx.HTTPError as error:
        raise ProbeFailed(f"{what}: no answer ({type(error).__name__}: {error})") from error
    if response.status_code != 200:
        raise ProbeFailed(f"{what}: answered {response.status_code}: {response.text[:300]}")
    try:
        answer = response.json()
        tokens = int((answer.get("usage") or {}).get("completion_tokens") or 0)
    except (ValueError, TypeError, AttributeError) as error:
        raise ProbeFailed(f"{what}: answered 200 with no completion: {response.text[:300]}") from error
    if tokens < 1:
        raise ProbeFailed(f"{what}: answered 200 with no tokens: {response.text[:300]}")
    return tokens


def _health(client: httpx.Client, target: ProbeTarget) -> str:
    """Empty when the engine's /health answers 200, else what it did."""
    try:
        response = client.get(f"{target.base_url}/health")
    except httpx.HTTPError as error:
        return f"/health did not answer ({type(error).__name__}): the engine died"
    return "" if response.status_code == 200 else f"/health answered {response.status_code}"


def probe_features(target: ProbeTarget, flags: list[str]) -> ProbeOutcome:
    """Probe each feature of `flags` (CHUNKED_PREFILL, PREFIX_CACHING), then /health."""
    outcome = ProbeOutcome()
    probed: list[str] = []
    # Room for the prompt and its answer: vLLM refuses a prompt + max_tokens over max_model_len.
    room = target.max_model_len - MAX_TOKENS - 1
    headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
    with httpx.Client(timeout=target.timeout_s, headers=headers) as client:
        try:
            if CHUNKED_PREFILL in flags:
                length = target.max_num_batched_tokens + target.block_size
                if length > room:
                    outcome.lines.append(
                        f"chunked prefill not probed: max_model_len {target.max_model_len:,} leaves no "
                        f"room for a prompt longer than the {target.max_num_batched_tokens:,}-token budget"
                    )
                else:
                    probed.append(CHUNKED_PREFILL)
                    what = (
                        f"{feature_label(CHUNKED_PREFILL)}: a {length:,}-token prompt over the "
                        f"{target.max_num_batched_tokens:,}-token budget"
                    )
                    tokens = _complete(
                        client, target, _prompt(length, offset=0, vocab_size=target.vocab_size), what
                    )
                    outcome.lines.append(f"{what} answered {tokens} tokens")
            if PREFIX_CACHING in flags:
                # Whole blocks are what the cache keeps: four of them, or what the context allows.
                length = min(4 * target.block_size, room, target.max_num_batched_tokens)
                if length <= target.block_size:
                    outcome.lines.append(
                        f"prefix caching not probed: max_model_len {target.max_model_len:,} leaves no "
                        f"room for a prompt of more than one {target.block_size}-token block"
                    )
                else:
                    probed.append(PREFIX_CACHING)
                    prompt = _prompt(length, offset=target.vocab_size // 2, vocab_size=target.vocab_size)
                    label = feature_label(PREFIX_CACHING)
                    first = _complete(client, target, prompt, f"{label}: a {length:,}-token prompt")
                    again = _complete(
                        client, target, prompt, f"{label}: the same {length:,}-token prompt again"
                    )
                    outcome.lines.append(
                        f"{label}: a {length:,}-token prompt twice answered {first} and {again} tokens"
                    )
        except ProbeFailed as failure:
            health = _health(client, target)
            outcome.failure = f"{failure}" + (f"; {health}" if health else "")
            return outcome
        health = _health(client, target)
    if health:
        names = " and ".join(feature_label(flag) for flag in probed or flags)
        outcome.failure = f"after probing {names}, {health}"
    else:
        outcome.lines.append("/health OK after the probes")
    return outcome
