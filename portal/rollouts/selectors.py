"""Reads for rollouts."""

from __future__ import annotations

from django.db.models import QuerySet

from portal.teams.models import Team

from .models import Rollout


def rollouts_visible_to(user) -> QuerySet[Rollout]:
    """Staff see every rollout; a member sees the rollouts of the served names one of their teams
    may call (a team without an allowed list may call every name)."""
    rollouts = Rollout.objects.select_related(
        "served_model", "from_version", "to_version", "from_deployment", "to_deployment"
    )
    if user.is_staff:
        return rollouts
    allowed = list(Team.objects.filter(members=user).values_list("allowed_models", flat=True))
    if not allowed:
        return rollouts.none()
    if any(not names for names in allowed):
        return rollouts
    return rollouts.filter(served_model__name__in={name for names in allowed for name in names})
