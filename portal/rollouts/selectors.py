"""Reads for rollouts."""

from __future__ import annotations

from dataclasses import dataclass

from django.db.models import Prefetch, QuerySet

from portal.deployments.models import Deployment
from portal.registry.models import ServedModel, ServedModelVersion
from portal.teams.models import Team

from .models import ACTIVE_ROLLOUT_STATES, Rollout


def _allowed_names(user) -> set[str] | None:
    """The served names `user`'s teams may call; None: every name (staff, or a team without a list)."""
    if user.is_staff:
        return None
    allowed = list(Team.objects.filter(members=user).values_list("allowed_models", flat=True))
    if any(not names for names in allowed):
        return None
    return {name for names in allowed for name in names}


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


def served_models_visible_to(user) -> QuerySet[ServedModel]:
    """Staff see every served name; a member those one of their teams may call."""
    served = ServedModel.objects.prefetch_related(
        Prefetch("versions", queryset=ServedModelVersion.objects.select_related("model_version"))
    )
    if not user.is_staff and not Team.objects.filter(members=user).exists():
        return served.none()
    names = _allowed_names(user)
    return served if names is None else served.filter(name__in=names)


@dataclass(frozen=True)
class VersionLine:
    """One version behind a served name, as its page shows it."""

    name: str
    share_percent: float
    callable_by_name: bool
    replicas: list[Deployment]  # its deployments wanted running, with their states


def served_model_lines(served: ServedModel) -> list[VersionLine]:
    lines = []
    for row in served.versions.select_related("model_version"):
        replicas = list(
            Deployment.objects.filter(model_version=row.model_version, desired_state="running").order_by(
                "name"
            )
        )
        version = row.model_version
        lines.append(VersionLine(version.name, row.share_percent, version.callable_by_name, replicas))
    return lines


def active_rollout_of(served: ServedModel) -> Rollout | None:
    return served.rollouts.filter(state__in=list(ACTIVE_ROLLOUT_STATES)).first()


def rollout_warnings(rollout: Rollout) -> list[str]:
    """What the start warned about (other hardware than the old version's), oldest first."""
    return list(rollout.events.filter(kind="warning").values_list("message", flat=True))
