"""Writes of teams themselves."""

from __future__ import annotations

from django.db import transaction

from portal.audit.services import audit_event_record
from portal.core.errors import clean_or_raise

from ..models import Team


@transaction.atomic
def team_create(*, slug: str, name: str = "", gpu_quota: int = 0) -> Team:
    """A new team (`manage.py create_team`); its name defaults to the slug."""
    team = Team(slug=slug, name=name or slug, gpu_quota=gpu_quota)
    clean_or_raise(team)
    team.save()
    audit_event_record(action="team.create", target=team, changes={"slug": slug, "gpu_quota": gpu_quota})
    return team
