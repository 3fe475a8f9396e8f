"""Writes for the playground: the member's playground key, made on first use.

The playground calls the gateway as a key of the team, so quotas, admission and
usage apply unchanged. One key per (team, member), named "playground (<user>)"
so usage says whose it is. It is hashed like every key and its secret is dropped
at once: the member's session stands for it, and nothing can send it as a bearer
token.
"""

from __future__ import annotations

from django.db import IntegrityError, transaction

from portal.teams.models import ApiKey, Team
from portal.teams.services import api_key_create


def playground_key_for(*, team: Team, user) -> ApiKey:
    """The member's playground key of `team` (with its team loaded), created on first use."""
    found = ApiKey.objects.select_related("team").filter(team=team, playground_user=user).first()
    if found is not None:
        return found
    try:
        with transaction.atomic():
            name = f"playground ({user.get_username()})"[:100]
            key, _secret = api_key_create(team=team, name=name, created_by=user)
            # Claimed by a conditional UPDATE: a second first use racing this one hits the unique
            # constraint and takes the winner's key instead.
            ApiKey.objects.filter(pk=key.pk, playground_user__isnull=True).update(playground_user=user)
    except IntegrityError:
        pass
    return ApiKey.objects.select_related("team").get(team=team, playground_user=user)
