"""Reads for teams, scoped to what a user may see: staff see every team, members their own."""

from __future__ import annotations

import datetime as dt
import json
import time
from collections import Counter

import redis
from django.db.models import Count, F, Q, QuerySet, Sum
from django.db.models.functions import TruncHour
from django.shortcuts import get_object_or_404
from django.utils import timezone

from portal.core.redis.client import gateway_redis, redis_keys
from portal.registry.models import ModelVersion, ServedModel
from portal.registry.selectors import acceptance_model_q

from .models import (
    BILLED,
    ApiKey,
    PriorityClass,
    Team,
    Usage,
    UsageDaily,
    UsageHourly,
    UsageStatus,
    source_of_key,
)


def teams_visible_to(user) -> QuerySet[Team]:
    teams = Team.objects.all()
    return teams if user.is_staff else teams.filter(members=user)


def team_get_for_user(user, slug: str) -> Team:
    return get_object_or_404(teams_visible_to(user), slug=slug)


def model_names_for_team(team: Team) -> list[str]:
    """Registered model and served names the team may call (its allowed list, else every one);
    never a node acceptance's random-weight reference model (issue 38: they filled the key form)."""
    names = set(ModelVersion.objects.exclude(acceptance_model_q()).values_list("name", flat=True))
    names |= set(ServedModel.objects.values_list("name", flat=True))
    if team.allowed_models:
        names &= set(team.allowed_models)
    return sorted(names)


def served_names_for_team(team: Team) -> list[str]:
    """The served names among `model_names_for_team`: the stable names clients should call."""
    names = set(ServedModel.objects.values_list("name", flat=True))
    if team.allowed_models:
        names &= set(team.allowed_models)
    return sorted(names)


def example_model_for_key(team: Team, allowed_models: list[str]) -> str:
    """A model for a new key's snippets that the key may call: the first of its own list, else of its
    team's, else a served name, else a registered model the team may use; "MODEL" with none at all."""
    listed = allowed_models or team.allowed_models
    if listed:
        return listed[0]
    names = model_names_for_team(team)
    served = set(ServedModel.objects.values_list("name", flat=True))
    return next((name for name in names if name in served), names[0] if names else "MODEL")


def api_keys_of(team: Team) -> QuerySet[ApiKey]:
    """The team's keys, without the playground's and the benchmarks' (their secrets exist nowhere,
    so there is nothing to manage; staff see them in the admin)."""
    # Live keys first: PostgreSQL sorts NULLs last unless told otherwise.
    return team.api_keys.filter(playground_user__isnull=True, benchmark_user__isnull=True).order_by(
        F("revoked_at").asc(nulls_first=True), "-created_at"
    )


def api_key_get_for_team(team: Team, prefix: str) -> ApiKey:
    return get_object_or_404(
        team.api_keys.filter(playground_user__isnull=True, benchmark_user__isnull=True), prefix=prefix
    )


def usage_daily_series(
    team: Team, *, days: int = 30, today: dt.date | None = None
) -> list[tuple[dt.date, int]]:
    """(day, tokens) for each of the last `days` UTC days, zeros included: the daily rollups for
    the days before today, and today's usage records themselves (the rollup lags by minutes)."""
    today = today or timezone.now().date()
    start = today - dt.timedelta(days=days - 1)
    totals = {
        row["day"]: (row["p"] or 0) + (row["c"] or 0)
        for row in UsageDaily.objects.filter(team=team, day__gte=start, day__lt=today)
        .values("day")
        .annotate(p=Sum("prompt_tokens"), c=Sum("completion_tokens"))
    }
    midnight = dt.datetime.combine(today, dt.time.min, tzinfo=dt.UTC)
    live = Usage.objects.filter(
        team=team, created_at__gte=midnight, created_at__lt=midnight + dt.timedelta(days=1)
    ).aggregate(p=Sum("prompt_tokens", filter=BILLED), c=Sum("completion_tokens", filter=BILLED))
    totals[today] = (live["p"] or 0) + (live["c"] or 0)
    return [(start + dt.timedelta(days=i), totals.get(start + dt.timedelta(days=i), 0)) for i in range(days)]


def usage_today(team: Team) -> dict:
    """Today's totals straight from the usage records (the rollup may lag by minutes): one UTC day
    of records at most, the largest raw read a page makes."""
    start = timezone.now().replace(hour=0, minute=0, second=0, microsecond=0)
    rows = Usage.objects.filter(team=team, created_at__gte=start)
    totals = rows.aggregate(
        requests=Count("id"),
        prompt=Sum("prompt_tokens", filter=BILLED),
        completion=Sum("completion_tokens", filter=BILLED),
    )
    by_status = dict(rows.values_list("status").annotate(n=Count("id")).values_list("status", "n"))
    return {
        "requests": totals["requests"] or 0,
        "tokens": (totals["prompt"] or 0) + (totals["completion"] or 0),
        "by_status": [(label, by_status.get(value, 0)) for value, label in UsageStatus.choices],
    }


def tokens_billed_on_day(*, kind: str, id: int, day: int) -> int:
    """Tokens a team or key (`kind` "team" or "key") was billed on UTC day number `day` (days since
    the epoch), from the usage records: what the gateway's daily counter held, less what was still
    queued in Redis. Refused and unavailable requests (`UNBILLED_STATUSES`) cost nothing; the rest
    cost their tokens."""
    start = dt.datetime(1970, 1, 1, tzinfo=dt.UTC) + dt.timedelta(days=day)
    rows = Usage.objects.filter(created_at__gte=start, created_at__lt=start + dt.timedelta(days=1))
    rows = rows.filter(team_id=id) if kind == "team" else rows.filter(api_key_id=id)
    totals = rows.aggregate(p=Sum("prompt_tokens", filter=BILLED), c=Sum("completion_tokens", filter=BILLED))
    return (totals["p"] or 0) + (totals["c"] or 0)


def usage_today_by_key(team: Team) -> list[dict]:
    """Today's requests and tokens per key, busiest first: {"key", "name", "source", "requests",
    "tokens"} (a member's playground key shows as "playground (<user>)", source "playground"; a
    member's benchmark key as "benchmark (<user>)", source "benchmark")."""
    start = timezone.now().replace(hour=0, minute=0, second=0, microsecond=0)
    rows = (
        Usage.objects.filter(team=team, created_at__gte=start)
        .values("api_key__prefix", "api_key__name", "api_key__playground_user", "api_key__benchmark_user")
        .annotate(
            requests=Count("id"),
            p=Sum("prompt_tokens", filter=BILLED),
            c=Sum("completion_tokens", filter=BILLED),
        )
    )
    out = [
        {
            "key": f"sk-{row['api_key__prefix']}…" if row["api_key__prefix"] else "(deleted key)",
            "name": row["api_key__name"] or "",
            "source": source_of_key(row["api_key__playground_user"], row["api_key__benchmark_user"]),
            "requests": row["requests"],
            "tokens": (row["p"] or 0) + (row["c"] or 0),
        }
        for row in rows
    ]
    return sorted(out, key=lambda r: (-r["tokens"], -r["requests"], r["key"]))


# Failures of the upstream, as the production latency rollups count them (observability).
UPSTREAM_FAILURES = (UsageStatus.UPSTREAM_ERROR, UsageStatus.TIMEOUT)


def usage_today_by_version(team: Team) -> list[dict]:
    """Today's requests and tokens per model name called and the version that served it (the
    version of the deployment recorded per request: a served name shows one row per version;
    refused requests, which reached no deployment, show version None). Busiest first."""
    start = timezone.now().replace(hour=0, minute=0, second=0, microsecond=0)
    rows = (
        Usage.objects.filter(team=team, created_at__gte=start)
        .values("model", "deployment__model_version__name")
        .annotate(requests=Count("id"), errors=Count("id", filter=Q(status__in=UPSTREAM_FAILURES)),
                  p=Sum("prompt_tokens", filter=BILLED), c=Sum("completion_tokens", filter=BILLED))
    )  # fmt: skip
    out = [
        {
            "model": row["model"],
            "version": row["deployment__model_version__name"],
            "requests": row["requests"],
            "errors": row["errors"],
            "tokens": (row["p"] or 0) + (row["c"] or 0),
        }
        for row in rows
    ]
    return sorted(out, key=lambda r: (-r["requests"], r["model"], r["version"] or ""))


def usage_by_priority_class(team: Team, *, days: int = 30) -> list[dict]:
    """Requests and tokens per priority class: today's straight from the usage records (as the rest
    of today's figures), and the last `days` UTC days: the daily rollups of the days before today
    plus today's records (so the totals never lag today's figures beside them).
    One row per class, every class present: {"priority_class", "today_requests", "today_tokens",
    "days_requests", "days_tokens"}."""
    start = timezone.now().replace(hour=0, minute=0, second=0, microsecond=0)
    today = {
        row["priority_class"]: row
        for row in Usage.objects.filter(team=team, created_at__gte=start)
        .values("priority_class")
        .annotate(
            requests=Count("id"),
            p=Sum("prompt_tokens", filter=BILLED),
            c=Sum("completion_tokens", filter=BILLED),
        )
    }
    first_day = start.date() - dt.timedelta(days=days - 1)
    rolled = {
        row["priority_class"]: row
        for row in UsageDaily.objects.filter(team=team, day__gte=first_day, day__lt=start.date())
        .values("priority_class")
        .annotate(requests=Sum("requests"), p=Sum("prompt_tokens"), c=Sum("completion_tokens"))
    }
    out = []
    for value in PriorityClass.values:
        t, r = today.get(value, {}), rolled.get(value, {})
        out.append(
            {
                "priority_class": value,
                "today_requests": t.get("requests") or 0,
                "today_tokens": (t.get("p") or 0) + (t.get("c") or 0),
                "days_requests": (r.get("requests") or 0) + (t.get("requests") or 0),
                "days_tokens": (r.get("p") or 0) + (r.get("c") or 0) + (t.get("p") or 0) + (t.get("c") or 0),
            }
        )
    return out


# Hours read from the usage records themselves rather than the hourly rollup: the current one and
# the one before, which the rollup (every few minutes) may not have caught up with yet.
RAW_HOURS = 2


def usage_hourly_series(
    team: Team, *, hours: int = 24, now: dt.datetime | None = None
) -> list[tuple[dt.datetime, int]]:
    """(hour, requests) for each of the last `hours` UTC hours, zeros included: the hourly rollup,
    and the usage records for the last RAW_HOURS only (never a day's worth of records)."""
    now = (now or timezone.now()).astimezone(dt.UTC).replace(minute=0, second=0, microsecond=0)
    start = now - dt.timedelta(hours=hours - 1)
    raw_from = max(start, now - dt.timedelta(hours=RAW_HOURS - 1))
    counts = {
        hour.astimezone(dt.UTC): n
        for hour, n in UsageHourly.objects.filter(team=team, hour__gte=start, hour__lt=raw_from)
        .values_list("hour")
        .annotate(n=Sum("requests"))
        .values_list("hour", "n")
    }
    counts.update(
        (hour.astimezone(dt.UTC), n)
        for hour, n in Usage.objects.filter(team=team, created_at__gte=raw_from)
        .annotate(hour=TruncHour("created_at", tzinfo=dt.UTC))
        .values_list("hour")
        .annotate(n=Count("id"))
        .values_list("hour", "n")
    )
    return [
        (start + dt.timedelta(hours=i), counts.get(start + dt.timedelta(hours=i), 0)) for i in range(hours)
    ]


def usage_daily_all_teams(*, days: int = 30) -> list[tuple[dt.date, int]]:
    today = timezone.now().date()
    start = today - dt.timedelta(days=days - 1)
    totals = {
        row["day"]: (row["p"] or 0) + (row["c"] or 0)
        for row in UsageDaily.objects.filter(day__gte=start)
        .values("day")
        .annotate(p=Sum("prompt_tokens"), c=Sum("completion_tokens"))
    }
    return [(start + dt.timedelta(days=i), totals.get(start + dt.timedelta(days=i), 0)) for i in range(days)]


def usage_dead_letters(*, newest: int = 10) -> tuple[int, Counter, list[dict]]:
    """The dead-letter list of the usage flush: its length, its reasons counted, and its newest
    `newest` entries ({"reason", "at", "record"}), newest first."""
    client = gateway_redis()
    dead = redis_keys().usage_dead
    entries = [json.loads(raw) for raw in client.lrange(dead, 0, -1)]
    return len(entries), Counter(e["reason"] for e in entries), entries[::-1][:newest]


def team_in_flight(team: Team) -> int | None:
    """Requests of the team in flight now, from the gateway's concurrency set (None if Redis is
    down or hung: the client's timeout bounds the wait)."""
    try:
        now_ms = int(time.time() * 1000)
        return gateway_redis().zcount(redis_keys().concurrency("team", team.pk), now_ms, "+inf")
    except redis.RedisError:
        return None
