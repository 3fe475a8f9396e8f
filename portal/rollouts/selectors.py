"""Reads for rollouts."""

from __future__ import annotations

from dataclasses import dataclass

from django.db.models import Prefetch, Q, QuerySet

from portal.deployments.models import Deployment
from portal.deployments.selectors import deployments_visible_to
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


def _reached(user) -> QuerySet:
    """The ids of the deployments `user` may see (deployments' own scoping): a member sees a
    rollout or a served name only through one of these, never another team's private replicas,
    measurements and notes."""
    return deployments_visible_to(user).order_by().values("pk")


def rollouts_visible_to(user) -> QuerySet[Rollout]:
    """Staff see every rollout; a member those from or to a deployment of their team, of a served
    name one of their teams may call (a team without an allowed list may call every name)."""
    rollouts = Rollout.objects.select_related(
        "served_model", "from_version", "to_version", "from_deployment", "to_deployment"
    )
    if user.is_staff:
        return rollouts
    reached = _reached(user)
    rollouts = rollouts.filter(Q(from_deployment__in=reached) | Q(to_deployment__in=reached))
    names = _allowed_names(user)
    return rollouts if names is None else rollouts.filter(served_model__name__in=names)


def served_models_visible_to(user) -> QuerySet[ServedModel]:
    """Staff see every served name; a member those over a deployment of their team that one of
    their teams may call."""
    served = ServedModel.objects.prefetch_related(
        Prefetch("versions", queryset=ServedModelVersion.objects.select_related("model_version"))
    )
    if user.is_staff:
        return served
    served = served.filter(
        pk__in=ServedModel.objects.filter(versions__model_version__deployments__in=_reached(user)).values(
            "pk"
        )
    )
    names = _allowed_names(user)
    return served if names is None else served.filter(name__in=names)


def rollout_deployments_shown(user, rollout: Rollout) -> set[int]:
    """The ids of `rollout`'s deployments (from, to, freed) whose names `user` may read: a member
    of the new version's team does not learn the name of the old one's, if another team's."""
    both = (rollout.from_deployment_id, rollout.to_deployment_id, rollout.freed_deployment_id)
    ids = {pk for pk in both if pk is not None}
    if user.is_staff:
        return ids
    return set(deployments_visible_to(user).filter(pk__in=ids).values_list("pk", flat=True))


@dataclass(frozen=True)
class VersionLine:
    """One version behind a served name, as its page shows it."""

    name: str
    share_percent: float
    callable_by_name: bool
    replicas: list[Deployment]  # its deployments wanted running, with their states


def served_model_lines(served: ServedModel, user) -> list[VersionLine]:
    """The versions behind `served`, each with the replicas `user` may see."""
    lines = []
    visible = deployments_visible_to(user)
    for row in served.versions.select_related("model_version"):
        replicas = list(
            visible.filter(model_version=row.model_version, desired_state="running").order_by("name")
        )
        version = row.model_version
        lines.append(VersionLine(version.name, row.share_percent, version.callable_by_name, replicas))
    return lines


def active_rollout_of(served: ServedModel, user) -> Rollout | None:
    """The rollout in progress on `served`, if `user` may see it."""
    return (
        rollouts_visible_to(user).filter(served_model=served, state__in=list(ACTIVE_ROLLOUT_STATES)).first()
    )


def rollout_warnings(rollout: Rollout) -> list[str]:
    """What the start warned about (other hardware than the old version's), oldest first."""
    return list(rollout.events.filter(kind="warning").values_list("message", flat=True))
