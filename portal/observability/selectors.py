"""Reads for the ops dashboard (the gateway's traffic per minute over the last hour, open SLA
breaches) and the deployment page (production latency over time, the benchmark's operating point)."""

from __future__ import annotations

import datetime as dt
import time
from collections import defaultdict
from dataclasses import dataclass

import redis

from portal.benchmarks.models import FINISHED_STATES, BenchmarkRun
from portal.core.redis.client import redis_keys

from . import prometheus
from .models import LatencyMinute, SlaBreach


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
        with prometheus.client().pipeline(transaction=False) as pipe:
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


# --- Production latency of one deployment (the deployment page) ------------------------------

# Window name → (length, minutes per point): about 60, 288 and 336 points.
LATENCY_WINDOWS: dict[str, tuple[dt.timedelta, int]] = {
    "hour": (dt.timedelta(hours=1), 1),
    "day": (dt.timedelta(days=1), 5),
    "week": (dt.timedelta(days=7), 30),
}


@dataclass(frozen=True)
class LatencyPoint:
    """One point of a chart: a minute, or several merged. A merged point shows the worst minute's
    P95 (what an SLA judged per minute would have seen) and the request-weighted mean of the P50s."""

    start: dt.datetime
    requests: int
    errors: int
    p50_ttft_ms: float | None
    p95_ttft_ms: float | None
    p50_tpot_ms: float | None
    p95_tpot_ms: float | None
    p50_e2e_ms: float | None = None
    p95_e2e_ms: float | None = None


def _merge(start: dt.datetime, rows: list[LatencyMinute]) -> LatencyPoint:
    def worst(field: str) -> float | None:
        return max((v for r in rows if (v := getattr(r, field)) is not None), default=None)

    def weighted(field: str) -> float | None:
        pairs = [(v, r.requests) for r in rows if (v := getattr(r, field)) is not None]
        weight = sum(n for _, n in pairs)
        return sum(v * n for v, n in pairs) / weight if weight else None

    return LatencyPoint(
        start=start,
        requests=sum(r.requests for r in rows),
        errors=sum(r.errors for r in rows),
        p50_ttft_ms=weighted("p50_ttft_ms"),
        p95_ttft_ms=worst("p95_ttft_ms"),
        p50_tpot_ms=weighted("p50_tpot_ms"),
        p95_tpot_ms=worst("p95_tpot_ms"),
        p50_e2e_ms=weighted("p50_e2e_ms"),
        p95_e2e_ms=worst("p95_e2e_ms"),
    )


def latency_series(
    deployment_id: int, *, window: str, now: dt.datetime
) -> tuple[dt.datetime, dt.datetime, list[LatencyPoint]]:
    """(start, end, points with requests, oldest first) of one deployment over a window (one query)."""
    length, step = LATENCY_WINDOWS[window]
    end = now.astimezone(dt.UTC).replace(second=0, microsecond=0) + dt.timedelta(minutes=1)
    start = end - length
    buckets: dict[dt.datetime, list[LatencyMinute]] = defaultdict(list)
    for row in LatencyMinute.objects.filter(deployment_id=deployment_id, minute__gte=start, minute__lt=end):
        offset = int((row.minute - start).total_seconds() // 60) // step * step
        buckets[start + dt.timedelta(minutes=offset)].append(row)
    return start, end, [_merge(at, rows) for at, rows in sorted(buckets.items())]


@dataclass(frozen=True)
class OperatingPoint:
    """The SLA operating point of the deployment's latest finished benchmark run that found one."""

    run: BenchmarkRun
    concurrency: int
    p95_ttft_ms: float | None
    p95_tpot_ms: float | None


def benchmark_operating_point(deployment_id: int) -> OperatingPoint | None:
    run = (
        BenchmarkRun.objects.filter(
            deployment_id=deployment_id, state__in=FINISHED_STATES, sla_concurrency__isnull=False
        )
        .order_by("-created_at", "-id")
        .first()
    )
    if run is None:
        return None
    assert run.sla_concurrency is not None  # filtered above
    level = run.levels.filter(concurrency=run.sla_concurrency).order_by("index").first()
    results = level.results if level else {}
    return OperatingPoint(run, run.sla_concurrency, results.get("p95_ttft_ms"), results.get("p95_tpot_ms"))


def sla_breaches(
    *, deployment_id: int | None = None, open_only: bool = False, limit: int = 20
) -> list[SlaBreach]:
    """Breaches, newest first, with their deployments (one query)."""
    breaches = SlaBreach.objects.select_related("deployment")
    if deployment_id is not None:
        breaches = breaches.filter(deployment_id=deployment_id)
    if open_only:
        breaches = breaches.filter(ended_at__isnull=True)
    return list(breaches.order_by("-started_at", "-id")[:limit])
