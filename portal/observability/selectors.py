"""Reads for the ops dashboard: the gateway's traffic per minute over the last hour."""

from __future__ import annotations

import datetime as dt
import time
from dataclasses import dataclass

import redis

from portal.core.redis_client import redis_keys

from . import metrics


@dataclass(frozen=True)
class TrafficMinute:
    start: dt.datetime  # UTC
    seconds: float  # how much of the minute has passed (60 except the current one)
    requests: int
    tokens: int
    errors: int  # upstream failed or timed out (usage status upstream_error / timeout)
    rejected: int  # refused by the gateway: bad key, quotas, queue full or timed out, bad input
    queue_depth: int | None  # the largest total sampled in the minute (None: no sample)

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.seconds

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def traffic_last_hour(*, minutes: int = 60, now: float | None = None) -> list[TrafficMinute] | None:
    """One entry per minute, oldest first, the current (partial) minute last; None if Redis is down."""
    now = time.time() if now is None else now
    current = int(now // 60)
    wanted = list(range(current - minutes + 1, current + 1))
    keys = redis_keys()
    try:
        with metrics.client().pipeline(transaction=False) as pipe:
            for minute in wanted:
                pipe.hgetall(keys.metrics_minute(minute))
            rows = pipe.execute()
    except redis.RedisError:
        return None
    out = []
    for minute, row in zip(wanted, rows, strict=True):
        values = {k.decode(): int(v) for k, v in row.items()}
        out.append(
            TrafficMinute(
                start=dt.datetime.fromtimestamp(minute * 60, tz=dt.UTC),
                seconds=max(1.0, min(60.0, now - minute * 60)),
                requests=values.get("requests", 0),
                tokens=values.get("prompt_tokens", 0) + values.get("completion_tokens", 0),
                errors=values.get("errors", 0),
                rejected=values.get("rejected", 0),
                queue_depth=values.get("queue_depth"),
            )
        )
    return out
