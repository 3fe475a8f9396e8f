"""Daily token budgets: the backstop that disables a team or key whose day's tokens reached it."""

from __future__ import annotations

import datetime as dt

from django.db import transaction
from django.db.models import Sum
from django.utils import timezone

from ..models import ApiKey, Team, UsageDaily
from .blocks import gateway_block


def budgets_enforce(*, day: dt.date) -> list[str]:
    """Disable, until the next UTC midnight, every team and key whose tokens on `day` reached
    its daily budget (a backstop: the admission script already refuses requests over it).
    Returns what was disabled, e.g. ["team search", "key sk-ab12…"]."""
    until = dt.datetime.combine(day + dt.timedelta(days=1), dt.time.min, tzinfo=dt.UTC)
    if until <= timezone.now():
        return []
    done = []
    totals = UsageDaily.objects.filter(day=day)
    per_team = totals.values("team_id").annotate(t=Sum("prompt_tokens") + Sum("completion_tokens"))
    per_key = (
        totals.exclude(api_key=None)
        .values("api_key_id")
        .annotate(t=Sum("prompt_tokens") + Sum("completion_tokens"))
    )
    for row in per_team:
        team = Team.objects.get(pk=row["team_id"])
        if team.tokens_per_day and row["t"] >= team.tokens_per_day and not team.is_disabled():
            reason = f"daily budget of {team.tokens_per_day} tokens spent on {day}"
            Team.objects.filter(pk=team.pk).update(disabled_until=until, disabled_reason=reason)
            transaction.on_commit(
                lambda pk=team.pk, r=reason: gateway_block("team", pk, reason=r, until=until)
            )
            done.append(f"team {team.slug}")
    for row in per_key:
        key = ApiKey.objects.get(pk=row["api_key_id"])
        if key.tokens_per_day and row["t"] >= key.tokens_per_day and not key.is_disabled():
            reason = f"daily budget of {key.tokens_per_day} tokens spent on {day}"
            ApiKey.objects.filter(pk=key.pk).update(disabled_until=until, disabled_reason=reason)
            transaction.on_commit(lambda pk=key.pk, r=reason: gateway_block("key", pk, reason=r, until=until))
            done.append(f"key {key}")
    return done
