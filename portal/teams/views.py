"""Team pages: members see their own team; staff see every team."""

from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.shortcuts import get_object_or_404, render

from portal.deployments.selectors import deployments_visible_to
from portal.deployments.services import team_gpus_held

from .models import Team


def team_get_for_user(user, slug: str) -> Team:
    teams = Team.objects.all() if user.is_staff else Team.objects.filter(members=user)
    return get_object_or_404(teams, slug=slug)


@login_required
def team_detail(request, slug: str):
    team = team_get_for_user(request.user, slug)
    return render(
        request,
        "teams/team_detail.html",
        {
            "team": team,
            "gpus_held": team_gpus_held(team),
            "deployments": deployments_visible_to(request.user).filter(team=team),
        },
    )
