"""Writes for the playground: the member's playground key, made on first use.

The playground calls the gateway as a key of the team, so quotas, admission and
usage apply unchanged. One key per (team, member), named "playground (<user>)"
so usage says whose it is. It is hashed like every key and its secret is dropped
at once: the member's session stands for it, and nothing can send it as a bearer
token.
"""

from __future__ import annotations

from portal.teams.models import ApiKey, Team
from portal.teams.services import member_key_for


def playground_key_for(*, team: Team, user) -> ApiKey:
    """The member's playground key of `team` (with its team loaded), created on first use."""
    return member_key_for(team=team, user=user, purpose="playground")
