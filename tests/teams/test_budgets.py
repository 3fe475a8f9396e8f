"""Daily budgets: the backstop finds who spent theirs in a fixed number of queries."""

from __future__ import annotations

import datetime as dt

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from portal.teams.models import ApiKey, Team, UsageDaily
from portal.teams.services import api_key_create, budgets_enforce, usage_flush, usage_rollup
from tests.helpers.usage import push, record

pytestmark = pytest.mark.django_db


def spent(team: Team, key: ApiKey | None, tokens: int) -> None:
    UsageDaily.objects.create(
        day=timezone.now().date(), team=team, api_key=key, model="m1", requests=1, prompt_tokens=tokens
    )


def over_budget_teams(n: int, start: int) -> None:
    for i in range(start, start + n):
        team = Team.objects.create(name=f"t{i}", slug=f"t{i}", tokens_per_day=10)
        key, _ = api_key_create(team=team, tokens_per_day=5)
        spent(team, key, 20)


def enforce_counting_queries() -> tuple[list[str], int]:
    with CaptureQueriesContext(connection) as queries:
        disabled = budgets_enforce(day=timezone.now().date())
    return disabled, len(queries)


def test_it_takes_as_many_queries_for_many_teams_and_keys_as_for_one(gw):
    over_budget_teams(1, start=0)
    one, queries_for_one = enforce_counting_queries()
    over_budget_teams(5, start=1)
    five, queries_for_five = enforce_counting_queries()
    assert len(one) == 2 and len(five) == 10  # the first team and key stay disabled: not counted again
    assert queries_for_five == queries_for_one


def test_it_leaves_alone_who_has_no_budget_is_under_it_or_is_already_disabled(gw):
    no_budget = Team.objects.create(name="free", slug="free")
    under = Team.objects.create(name="under", slug="under", tokens_per_day=100)
    already = Team.objects.create(name="already", slug="already", tokens_per_day=10)
    Team.objects.filter(pk=already.pk).update(
        disabled_until=timezone.now() + dt.timedelta(hours=1), disabled_reason="by hand"
    )
    for team in (no_budget, under, already):
        spent(team, None, 50)
    assert budgets_enforce(day=timezone.now().date()) == []
    assert Team.objects.get(pk=already.pk).disabled_reason == "by hand"


def test_it_does_not_disable_a_team_for_prompts_it_was_refused(gw, team):
    """The rollup once summed refused requests' prompts, and the backstop disabled the team until
    midnight although nothing had run."""
    team.tokens_per_day = 1_000
    team.save()
    key, _ = api_key_create(team=team)
    push(gw, *[record(team, key, status="rejected", prompt=75_004, completion=0) for _ in range(3)])
    usage_flush()
    usage_rollup(day=timezone.now().date())
    assert UsageDaily.objects.get(team=team).rejected == 3
    assert budgets_enforce(day=timezone.now().date()) == []
    team.refresh_from_db()
    assert not team.is_disabled()
