"""Daily token budgets: the backstop that disables a team or key whose day's tokens reached it."""

from __future__ import annotations

import datetime as dt
import functools

from django.db import transaction
from django.db.models import F, OuterRef, QuerySet, Subquery, Sum
from django.utils import timezone

from ..models import ApiKey, Team, UsageDaily
from .blocks import gateway_block


def budgets_enforce(*, day: dt.date) -> list[str]:
    """Disable, until the next UTC midnight, every team and key whose tokens on `day` reached
    its daily budget (a backstop: the admission script already refuses requests over it).
    Returns what was disabled, e.g. ["team search", "key sk-ab12…"].

    Set-based: one query finds the teams over budget and one the keys, each disabled in one
    update, whatever the number of teams and keys."""
    until = dt.datetime.combine(day + dt.timedelta(days=1), dt.time.min, tzinfo=dt.UTC)
    now = timezone.now()
    if until <= now:
        return []
    teams = list(_over_budget(Team.objects.only("pk", "slug", "tokens_per_day"), "team", day, now))
    keys = list(_over_budget(ApiKey.objects.only("pk", "prefix", "tokens_per_day"), "api_key", day, now))
    _disable(Team, "team", teams, until=until, day=day)
    _disable(ApiKey, "key", keys, until=until, day=day)
    return [f"team {team.slug}" for team in teams] + [f"key {key}" for key in keys]


def _disable(
    model: type[Team] | type[ApiKey], kind: str, rows: list, *, until: dt.datetime, day: dt.date
) -> None:
    for row in rows:
        row.disabled_until = until
        row.disabled_reason = f"daily budget of {row.tokens_per_day} tokens spent on {day}"
    model.objects.bulk_update(rows, ["disabled_until", "disabled_reason"])
    # Refused by the gateway from now on, in every web process (once the update is committed).
    for row in rows:
        transaction.on_commit(
            functools.partial(gateway_block, kind, row.pk, reason=row.disabled_reason, until=until)
        )


def _over_budget(rows: QuerySet, usage_field: str, day: dt.date, now: dt.datetime) -> QuerySet:
    """The teams (or keys) of `rows` with a daily budget, not disabled now, whose tokens on `day`
    (their daily rows summed; `usage_field` names them on `UsageDaily`) reached it. The rows hold
    billed tokens only: a refused request's prompt never counts toward a budget (rollups.py)."""
    spent = (
        UsageDaily.objects.filter(day=day, **{usage_field: OuterRef("pk")})
        .order_by()
        .values(usage_field)
        .annotate(tokens=Sum("prompt_tokens") + Sum("completion_tokens"))
        .values("tokens")
    )
    return (
        rows.filter(tokens_per_day__gt=0)
        .exclude(disabled_until__gt=now)
        .annotate(spent=Subquery(spent))
        .filter(spent__gte=F("tokens_per_day"))
        .order_by("pk")
    )
