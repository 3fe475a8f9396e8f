"""What admission takes and gives: a scope's quotas, an admission, a replica slot grant, and the
arithmetic of batch shares and prompt slots. Plain records, shared by the limiter and the gateway's steps."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Limits:
    """The quotas of one scope (a team or a key); None = no limit."""

    rpm: int | None = None
    tpm: int | None = None
    tokens_per_day: int | None = None
    max_concurrent: int | None = None


@dataclass(frozen=True)
class Scope:
    kind: str  # "team" or "key"
    id: int | str
    limits: Limits = field(default_factory=Limits)


@dataclass
class Admission:
    ok: bool
    reason: str = ""
    retry_after_s: float = 0.0  # negative: retrying cannot help (the request alone exceeds the quota)
    day: int = 0
    tokens: int = 0
    at_us: int = 0  # Redis's time when it was admitted (µs: a rebuild of its daily counter is ordered by it)


@dataclass
class SlotGrant:
    """Where a request was admitted (index into the candidates) or why not."""

    index: int | None
    reason: str = ""  # "queue_full" | "queue_timeout" when index is None
    waited_s: float = 0.0
    slots: int = 1  # replica slots taken: one per prompt


def batch_limit(cap: int | None, share: float) -> int | None:
    """The in-flight count a batch request may bring a replica to: it may start only while in
    flight < share × cap, i.e. in flight < ceil(share × cap) (None: no cap, no limit).

    Computed here rather than in Lua so a share like 0.3 × 10 (3.0000000000000004 in floating
    point) gives 3, not 4."""
    if cap is None:
        return None
    return math.ceil(round(cap * share, 9))


def prompt_limit(caps: list[int | None], share: float | None) -> int | None:
    """The most prompts one request may carry on these replicas: every prompt takes a slot, so
    the largest cap (a batch request's: its batch limit); None when some replica has no cap."""
    limits = [cap if share is None else batch_limit(cap, share) for cap in caps]
    if not limits or any(limit is None for limit in limits):
        return None
    return max(limit for limit in limits if limit is not None)


def slot_members(request_id: str, slots: int) -> list[str]:
    """The members a request holds in a replica's in-flight set: one per slot."""
    return [request_id, *(f"{request_id}#{j}" for j in range(2, slots + 1))]
