"""Workloads: named mixes of prompt and output lengths, sampled reproducibly.

A mix is a set of buckets, each with a share of the requests and inclusive
ranges of prompt and output tokens. Sampling is stratified: a bucket with share
0.3 gets exactly round(0.3 × n) of n requests (largest remainder), so a short
run is not skewed by the luck of the draw; the order is then shuffled. The same
seed always gives the same list.

Prompt lengths of the field presets come from docs/v100-field-guide.md#measuring; output lengths
are our stated choice (docs/decisions.md). Output lengths are forced by the load
generator (`ignore_eos` + `max_tokens`) so runs are comparable.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inference.errors import InputError

SHARE_TOLERANCE = 1e-6
# Bounds on what a mix may ask for, wherever it comes from: 128k tokens is the longest context
# of the bundled models, and a prompt is built in memory by the load generator.
MAX_MIX_TOKENS = 131_072
MAX_BUCKETS = 32
MAX_NAME_CHARS = 100
# An inline JSON mix (the web pages and the API) is a short object, not a file's worth of text.
MAX_INLINE_CHARS = 4096
# A mix is an object of a list of objects of two-number lists: four levels. Deeper nesting is
# refused before parsing, since Python's parser raises RecursionError (not a JSON error) on it.
MAX_INLINE_DEPTH = 8


@dataclass(frozen=True)
class RequestSpec:
    """One request to send: exact prompt length and forced output length, in tokens."""

    prompt_tokens: int
    output_tokens: int
    # Requests with the same group share their first `shared_prefix_tokens` prompt tokens.
    prefix_group: int | None = None
    shared_prefix_tokens: int = 0


@dataclass(frozen=True)
class Bucket:
    """A share of the requests (0..1) with inclusive prompt and output token ranges."""

    share: float
    prompt_range: tuple[int, int]
    output_range: tuple[int, int]


@dataclass(frozen=True)
class Mix:
    """A named workload. With `shared_prefix_tokens` > 0 every request starts with one shared
    document of that many tokens (prefix group 0) and the buckets' prompt ranges are the
    lengths of the question that follows it."""

    name: str
    buckets: tuple[Bucket, ...]
    shared_prefix_tokens: int = 0

    def __post_init__(self) -> None:
        if not self.buckets:
            raise InputError("mix", f"mix {self.name!r} has no buckets")
        if len(self.buckets) > MAX_BUCKETS:
            raise InputError("mix", f"a mix has at most {MAX_BUCKETS} buckets, not {len(self.buckets)}")
        if len(self.name) > MAX_NAME_CHARS:
            raise InputError("mix", f"a mix name has at most {MAX_NAME_CHARS} characters")
        for index, bucket in enumerate(self.buckets):
            if not bucket.share > 0:
                raise InputError("mix", f"bucket {index + 1} of {self.name!r}: share must be > 0")
            for label, (low, high) in (("prompt", bucket.prompt_range), ("output", bucket.output_range)):
                if int(low) != low or int(high) != high or low < 1 or high < low:
                    raise InputError(
                        "mix",
                        f"bucket {index + 1} of {self.name!r}: {label} range {low}–{high} must be "
                        "whole numbers ≥ 1 with low ≤ high",
                    )
                if high > MAX_MIX_TOKENS:
                    raise InputError(
                        "mix",
                        f"bucket {index + 1} of {self.name!r}: {label} lengths are at most "
                        f"{MAX_MIX_TOKENS} tokens, got {high}",
                    )
        total = sum(bucket.share for bucket in self.buckets)
        if abs(total - 1.0) > SHARE_TOLERANCE:
            raise InputError(
                "mix",
                f"the shares of {self.name!r} add to {total * 100:.4g} %, they must add to 100 % "
                "(shares are fractions: 0.4 for 40 %)",
            )
        if not 0 <= self.shared_prefix_tokens <= MAX_MIX_TOKENS:
            raise InputError("mix", f"shared_prefix_tokens must be between 0 and {MAX_MIX_TOKENS}")

    def bucket_counts(self, n: int) -> list[int]:
        """How many of n requests each bucket gets: exact shares, largest remainder."""
        quotas = [bucket.share * n for bucket in self.buckets]
        counts = [int(quota) for quota in quotas]
        by_remainder = sorted(range(len(quotas)), key=lambda i: (-(quotas[i] - counts[i]), i))
        for i in by_remainder[: n - sum(counts)]:
            counts[i] += 1
        return counts

    def sample(self, n: int, *, seed: int = 0) -> list[RequestSpec]:
        """n requests drawn from the mix; the same seed gives the same list."""
        rng = random.Random(seed)  # noqa: S311 (reproducible sampling, not security)
        specs: list[RequestSpec] = []
        for bucket, count in zip(self.buckets, self.bucket_counts(n), strict=True):
            for _ in range(count):
                prompt = rng.randint(*bucket.prompt_range)
                output = rng.randint(*bucket.output_range)
                if self.shared_prefix_tokens:
                    specs.append(
                        RequestSpec(
                            prompt_tokens=self.shared_prefix_tokens + prompt,
                            output_tokens=output,
                            prefix_group=0,
                            shared_prefix_tokens=self.shared_prefix_tokens,
                        )
                    )
                else:
                    specs.append(RequestSpec(prompt_tokens=prompt, output_tokens=output))
        rng.shuffle(specs)
        return specs

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "shared_prefix_tokens": self.shared_prefix_tokens,
            "buckets": [
                {"share": b.share, "prompt": list(b.prompt_range), "output": list(b.output_range)}
                for b in self.buckets
            ],
        }


_SHORT_QA = Bucket(1.0, (100, 300), (200, 500))
_LONG_SUMMARY = Bucket(1.0, (2000, 3000), (500, 800))

PRESETS: dict[str, Mix] = {
    # docs/v100-field-guide.md#measuring: 40 % under 500 prompt tokens, 30 % 500–1500,
    # 20 % 1500–3000, 10 % over 3000.
    "field-mix": Mix(
        "field-mix",
        (
            Bucket(0.4, (50, 499), (200, 500)),
            Bucket(0.3, (500, 1499), (200, 500)),
            Bucket(0.2, (1500, 2999), (200, 500)),
            Bucket(0.1, (3000, 4000), (200, 500)),
        ),
    ),
    "short-qa": Mix("short-qa", (_SHORT_QA,)),
    "long-summary": Mix("long-summary", (_LONG_SUMMARY,)),
    "qa-summary-60-40": Mix(
        "qa-summary-60-40",
        (
            Bucket(0.6, _SHORT_QA.prompt_range, _SHORT_QA.output_range),
            Bucket(0.4, _LONG_SUMMARY.prompt_range, _LONG_SUMMARY.output_range),
        ),
    ),
    # One 2000-token document shared by every request, then a 20–100 token question.
    "prefix-shared": Mix("prefix-shared", (Bucket(1.0, (20, 100), (50, 150)),), shared_prefix_tokens=2000),
}


def _known(allow_files: bool) -> str:
    files = "a path to a mix JSON file" if allow_files else 'an inline JSON mix ({"buckets": [...]})'
    return ", ".join(PRESETS) + f", fixed:<in>:<out>, or {files}"


def _range(value: object, what: str) -> tuple[int, int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return (value, value)
    if isinstance(value, list | tuple) and len(value) == 2 and all(isinstance(v, int) for v in value):
        return (int(value[0]), int(value[1]))
    raise InputError("mix", f"{what} must be a number or [low, high], got {value!r}")


def mix_from_dict(data: object, *, default_name: str = "custom") -> Mix:
    """A mix from its JSON form: {"name", "buckets": [{"share", "prompt": [lo, hi], "output": [lo, hi]}],
    "shared_prefix_tokens"}."""
    if not isinstance(data, dict) or not isinstance(data.get("buckets"), list):
        raise InputError("mix", 'a mix file must be a JSON object with a "buckets" list')
    buckets = []
    for index, raw in enumerate(data["buckets"]):
        if not isinstance(raw, dict) or not isinstance(raw.get("share"), int | float):
            raise InputError("mix", f'bucket {index + 1} needs a numeric "share" (0.4 for 40 %)')
        buckets.append(
            Bucket(
                float(raw["share"]),
                _range(raw.get("prompt"), f"bucket {index + 1} prompt"),
                _range(raw.get("output"), f"bucket {index + 1} output"),
            )
        )
    prefix = data.get("shared_prefix_tokens", 0)
    if not isinstance(prefix, int):
        raise InputError("mix", "shared_prefix_tokens must be a whole number")
    return Mix(str(data.get("name") or default_name), tuple(buckets), shared_prefix_tokens=prefix)


def json_depth(text: str) -> int:
    """How deep the brackets of a JSON text nest (those inside strings do not count), read without
    parsing it: a bound checked before `json.loads`."""
    depth = deepest = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest


def load_mix(spec: str, *, allow_files: bool = False) -> Mix:
    """A preset name, `fixed:<in>:<out>`, an inline JSON mix, or (`allow_files`) a path to a mix JSON file.

    Files are for the command line only: from HTTP a path would make the server say which of
    its files exist and read any of them, however large, into the web process.
    """
    spec = (spec or "").strip()
    if spec in PRESETS:
        return PRESETS[spec]
    if spec.startswith("fixed:"):
        parts = spec.split(":")
        if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts[1:]):
            raise InputError("mix", f"{spec!r}: write fixed lengths as fixed:<in>:<out>, e.g. fixed:256:64")
        prompt, output = int(parts[1]), int(parts[2])
        return Mix(spec, (Bucket(1.0, (prompt, prompt), (output, output)),))
    if spec.startswith("{"):
        if len(spec) > MAX_INLINE_CHARS:
            raise InputError("mix", f"an inline JSON mix has at most {MAX_INLINE_CHARS} characters")
        if json_depth(spec) > MAX_INLINE_DEPTH:
            raise InputError("mix", f"an inline JSON mix nests at most {MAX_INLINE_DEPTH} levels deep")
        try:
            data = json.loads(spec)
        except json.JSONDecodeError as error:
            raise InputError("mix", f"the inline mix is not valid JSON: {error}") from error
        return mix_from_dict(data, default_name="inline")
    if not allow_files:
        # The same answer whether or not such a file exists: no oracle for the server's files.
        raise InputError("mix", f"unknown mix {spec[:100]!r}; known: {_known(False)}")
    path = Path(spec)
    if spec.endswith(".json") or path.is_file():
        try:
            data = json.loads(path.read_text())
        except OSError as error:
            raise InputError("mix", f"cannot read mix file {spec}: {error.strerror or error}") from error
        except json.JSONDecodeError as error:
            raise InputError("mix", f"mix file {spec} is not valid JSON: {error}") from error
        return mix_from_dict(data, default_name=path.stem)
    raise InputError("mix", f"unknown mix {spec!r}; known: {_known(True)}")


def fit_to_context(spec: RequestSpec, max_model_len: int | None) -> RequestSpec:
    """Shorten a prompt so prompt + forced output fit the server's context.

    vLLM refuses a request longer than its max_model_len with a 400; a mix drawn for
    an 8k context (the field mix's top bucket reaches 4000 prompt tokens) would then fail
    a few per cent of requests on a 4k model and no level could meet an SLA. The
    output length stays as drawn, so runs remain comparable on what is generated.
    """
    if max_model_len is None or spec.prompt_tokens + spec.output_tokens <= max_model_len:
        return spec
    prompt = max(1, max_model_len - spec.output_tokens)
    return RequestSpec(prompt, spec.output_tokens, spec.prefix_group, min(spec.shared_prefix_tokens, prompt))
