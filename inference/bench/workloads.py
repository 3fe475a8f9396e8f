"""Workloads: named mixes of prompt and output lengths, sampled reproducibly.

A mix is a set of buckets, each with a share of the requests and inclusive
ranges of prompt and output tokens. Sampling is stratified: a bucket with share
0.3 gets exactly round(0.3 × n) of n requests (largest remainder), so a short
run is not skewed by the luck of the draw; the order is then shuffled. The same
seed always gives the same list.

Prompt lengths of the field presets come from FIELD_NOTES.md; output lengths
are our stated choice (docs/decisions.md). Output lengths are forced by the load
generator (`ignore_eos` + `max_tokens`) so runs are comparable.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from inference.errors import InputError

SHARE_TOLERANCE = 1e-6


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
        total = sum(bucket.share for bucket in self.buckets)
        if abs(total - 1.0) > SHARE_TOLERANCE:
            raise InputError(
                "mix",
                f"the shares of {self.name!r} add to {total * 100:.4g} %, they must add to 100 % "
                "(shares are fractions: 0.4 for 40 %)",
            )
        if self.shared_prefix_tokens < 0:
            raise InputError("mix", "shared_prefix_tokens must be ≥ 0")

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

    def to_dict(self) -> dict:
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
    # FIELD_NOTES: 40 % under 500 prompt tokens, 30 % 500–1500, 20 % 1500–3000, 10 % over 3000.
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


def _known() -> str:
    return ", ".join(PRESETS) + ", fixed:<in>:<out>, or a path to a mix JSON file"


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


def load_mix(spec: str) -> Mix:
    """A preset name, `fixed:<in>:<out>`, or a path to a mix JSON file."""
    spec = (spec or "").strip()
    if spec in PRESETS:
        return PRESETS[spec]
    if spec.startswith("fixed:"):
        parts = spec.split(":")
        if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts[1:]):
            raise InputError("mix", f"{spec!r}: write fixed lengths as fixed:<in>:<out>, e.g. fixed:256:64")
        prompt, output = int(parts[1]), int(parts[2])
        return Mix(spec, (Bucket(1.0, (prompt, prompt), (output, output)),))
    path = Path(spec)
    if spec.endswith(".json") or path.is_file():
        try:
            data = json.loads(path.read_text())
        except OSError as error:
            raise InputError("mix", f"cannot read mix file {spec}: {error.strerror or error}") from error
        except json.JSONDecodeError as error:
            raise InputError("mix", f"mix file {spec} is not valid JSON: {error}") from error
        return mix_from_dict(data, default_name=path.stem)
    raise InputError("mix", f"unknown mix {spec!r}; known: {_known()}")
