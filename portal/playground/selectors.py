"""Reads for the playground: which team a member may chat as, and the models it can call."""

from __future__ import annotations

from django.shortcuts import get_object_or_404

from portal.deployments.selectors import CallableModel, models_callable_by, served_replicas
from portal.teams.models import Team


def playground_team_for(user, slug: str) -> Team:
    """A team the user is a member of. Staff are not let in to other teams' playgrounds: the
    requests are accounted to the team, under its quotas, so only its members may spend them."""
    return get_object_or_404(Team.objects.filter(members=user), slug=slug)


def playground_models(team: Team) -> list[CallableModel]:
    """What the team's keys can reach now (as on the team front page), with their contexts."""
    return models_callable_by(team, served_replicas())
