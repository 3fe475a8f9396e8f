"""Reads of deployments, scoped to what a user may see.

Staff see every deployment; everyone else sees only their teams'. Views and
APIs fetch deployments through these functions, never with an ad hoc `.get()`.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass

from django.db.models import Q, QuerySet, Value
from django.shortcuts import get_object_or_404

from portal.inventory.models import ACCEPTANCE_TEAM_SLUG, Node
from portal.registry.models import ModelVersion, ServedModelVersion
from portal.registry.selectors import acceptance_model_q
from portal.teams.models import Team

from .models import Deployment, DeploymentState, DesiredState, served_context_len


def deployments_visible_to(user) -> QuerySet[Deployment]:
    deployments = Deployment.objects.select_related("team", "model_version", "profile", "node")
    if user.is_staff:
        return deployments
    return deployments.filter(team__members=user).distinct()


def acceptance_deployment_q() -> Q:
    """Deployments a node acceptance made: of the acceptance team, or of one of its reference models."""
    return Q(team__slug=ACCEPTANCE_TEAM_SLUG) | acceptance_model_q("model_version__")


def acceptance_profile_q() -> Q:
    """Profiles a node acceptance made for its reference models."""
    return acceptance_model_q("model_version__")


def listed(queryset: QuerySet, artefact: Q, *, acceptance: bool) -> tuple[QuerySet, int]:
    """A main list without node acceptance's artefacts, and how many it left out; with `acceptance`,
    only those artefacts (the list's ?acceptance=show), and 0."""
    if acceptance:
        return queryset.filter(artefact), 0
    return queryset.exclude(artefact), queryset.filter(artefact).count()


def deployment_get_for_user(user, name: str) -> Deployment:
    return get_object_or_404(deployments_visible_to(user), name=name)


def team_reaches(team_id: int, *, owner_team_id: int, shared: bool) -> bool:
    """The one rule of reach: a team's keys use its own serving replicas and the shared ones."""
    return shared or owner_team_id == team_id


@dataclass(frozen=True)
class ServedReplica:
    """A serving replica as the gateway routes to it: a team reaches its own and shared ones."""

    model: str
    team_id: int
    shared: bool
    context_len: int | None  # vLLM's max_model_len (None: unknown)


def served_replicas() -> list[ServedReplica]:
    """Every serving replica the gateway routes to (one query)."""
    rows = (
        Deployment.objects.filter(state=DeploymentState.SERVING)
        .exclude(endpoint_url="")
        .values_list(
            "model_version__name",
            "team_id",
            "shared",
            "profile__max_model_len",
            "model_version__max_position_embeddings",
            "model_version__external",
        )
    )
    return [
        ServedReplica(
            model,
            team_id,
            shared,
            served_context_len(
                profile_max_model_len=mml, max_position_embeddings=positions, external=external
            ),
        )
        for model, team_id, shared, mml, positions, external in rows
    ]


@dataclass(frozen=True)
class CallableModel:
    """A model a team's keys can call now, and how long its requests may be."""

    name: str
    replicas: int
    # The smallest context among the replicas the team reaches: a request may land on any of them.
    context_len: int | None

    def max_tokens(self, clamp: int) -> int:
        """The largest max_tokens a request gets (before its prompt is taken from the context), which
        is also what a request without max_tokens gets: the team's clamp, within the context."""
        return min(clamp, self.context_len) if self.context_len else clamp

    def context_bound(self, clamp: int) -> bool:
        """True when the context, not the clamp, bounds max_tokens (then the prompt's tokens come off)."""
        return self.context_len is not None and self.context_len != 0 and self.context_len <= clamp


@dataclass(frozen=True)
class CallableNames:
    """What turns replicas' versions into the names a key calls (read once per page)."""

    hidden: frozenset[str]  # versions callable only through a served name
    served_by_version: dict[str, list[str]]  # version → the served names that give it a share


def callable_names() -> CallableNames:
    """One query: the versions hidden by name, and those behind a served name with a share."""
    served: dict[str, list[str]] = defaultdict(list)
    hidden = set()
    rows = ServedModelVersion.objects.filter(share_bp__gt=0).values_list(
        "model_version__name", "served_model__name"
    )
    hidden_rows = ModelVersion.objects.filter(callable_by_name=False).values_list("name", Value(""))
    for version, name in rows.union(hidden_rows, all=True):
        if name:
            served[version].append(name)
        else:
            hidden.add(version)
    return CallableNames(frozenset(hidden), dict(served))


def models_callable_by(
    team: Team, replicas: list[ServedReplica], names: CallableNames | None = None
) -> list[CallableModel]:
    """The names the team's keys reach, as the gateway's /v1/models lists them (gateway.routing):
    each served name where one of its versions with a share has a replica the team reaches, and
    each version by its own name unless it is callable only through a served name; within the
    team's allowed models if it has any. `names`: `callable_names()`, read once for many teams."""
    names = names or callable_names()
    allowed = set(team.allowed_models)
    found: dict[str, list[ServedReplica]] = defaultdict(list)
    for replica in replicas:
        if not team_reaches(team.pk, owner_team_id=replica.team_id, shared=replica.shared):
            continue
        if replica.model not in names.hidden:
            found[replica.model].append(replica)
        for served in names.served_by_version.get(replica.model, ()):
            found[served].append(replica)
    found = {name: mine for name, mine in found.items() if not allowed or name in allowed}
    return [
        CallableModel(name, len(mine), min((r.context_len for r in mine if r.context_len), default=None))
        for name, mine in sorted(found.items())
    ]


_URL_ORIGIN = re.compile(r"\bhttps?://[^\s/'\"]+")
# Steps whose whole message says where and how the server runs (argv, pid, log path).
STAFF_ONLY_STEPS = frozenset({"command", "launch", "port"})


def deployment_text_for(user, deployment: Deployment, text: str, *, step: str = "") -> str:
    """Text about a deployment (an event, a state reason) as `user` may read it.

    Where servers listen is for staff only (docs/decisions.md, engine API keys): for
    anyone else URLs and the node's hostname are blanked out.
    """
    if user.is_staff or not text:
        return text
    if step in STAFF_ONLY_STEPS:
        return "(shown to staff only)"
    text = _URL_ORIGIN.sub("<server>", text)
    node = deployment.node
    if node is not None and node.hostname and node.hostname != node.name:
        text = text.replace(node.hostname, "<node>")
    return text


def serving_deployments_for_model(model_name: str) -> QuerySet[Deployment]:
    """Deployments the gateway may route `model_name` to: serving, with an endpoint.

    A deployment serves its model version under the version's name (vLLM's
    `--served-model-name`); `endpoint_url` is the server's root URL (no `/v1`).
    """
    return (
        Deployment.objects.select_related("model_version", "team", "profile")
        .filter(state="serving", model_version__name=model_name)
        .exclude(endpoint_url="")
    )


# --- Which GPUs are held ------------------------------------------------------------------------
# A deployment holds its GPUs while it is wanted running, whatever its state: a start in flight, a
# restart backoff or a failure the operator has not yet stopped all keep them from anyone else.


def _holding(exclude_deployment_id: int | None = None) -> QuerySet[Deployment]:
    deployments = Deployment.objects.filter(desired_state=DesiredState.RUNNING)
    if exclude_deployment_id is not None:
        deployments = deployments.exclude(pk=exclude_deployment_id)
    return deployments


def gpus_held_on_node(node: Node, *, exclude_deployment_id: int | None = None) -> dict[int, str]:
    """GPU index → name of the deployment that holds it, on one node."""
    held: dict[int, str] = {}
    for name, indices in _holding(exclude_deployment_id).filter(node=node).values_list("name", "gpu_indices"):
        for index in indices or []:
            held[index] = name
    return held


def gpus_held_per_node() -> dict[int, set[int]]:
    """Node id → indices of its held GPUs, for every node (one query)."""
    held: dict[int, set[int]] = defaultdict(set)
    for node_id, indices in _holding().filter(node__isnull=False).values_list("node_id", "gpu_indices"):
        held[node_id].update(indices or [])
    return held


def gpus_held_by_team(team: Team, *, exclude_deployment_id: int | None = None) -> int:
    """How many GPUs the team's deployments hold (what its `gpu_quota` bounds)."""
    indices = _holding(exclude_deployment_id).filter(team=team).values_list("gpu_indices", flat=True)
    return sum(len(i or []) for i in indices)


def pending_unclaimed_note(deployment: Deployment, *, last_event_at, now) -> str | None:
    """Why a `pending` deployment has not moved, once DEPLOYMENT_PENDING_WARN_S has passed since its
    last step: no agent took the start from the node's queue. Says whether the node's agent answers
    its heartbeat, so "pending" never looks like work in progress when nothing listens."""
    from django.conf import settings

    if deployment.state != DeploymentState.PENDING or deployment.adopted or deployment.node is None:
        return None
    since = last_event_at or deployment.created_at
    waited = (now - since).total_seconds()
    if waited < settings.DEPLOYMENT_PENDING_WARN_S:
        return None
    node = deployment.node
    agent = node.agent
    head = f"No agent has picked this up for {_duration(waited)}"
    if agent.listening:
        return (
            f"{head}, though the agent of {node.name} answered its heartbeat {_duration(agent.age_s)} ago: "
            "it may be busy with a long job (an acceptance, a conversion); the start runs after it."
        )
    seen = "has never answered" if agent.seen_at is None else f"last answered {_duration(agent.age_s)} ago"
    return (
        f"{head}: no agent is listening on node {node.name} (its agent {seen}). Start one on the node: "
        f"celery -A portal worker -Q {node.queue}"
    )


def _duration(seconds: float | None) -> str:
    seconds = int(seconds or 0)
    if seconds < 120:
        return f"{seconds} s"
    if seconds < 7200:
        return f"{seconds // 60} min"
    if seconds < 172800:
        return f"{seconds // 3600} h"
    return f"{seconds // 86400} days"


def deployment_ids_existing(ids: set[int]) -> set[int]:
    """Which of these deployment ids still exist: the usage flush's check before it links a record
    to its deployment (teams, below deployments, is given this at start-up: `apps.py`)."""
    return set(Deployment.objects.filter(pk__in=ids).values_list("pk", flat=True)) if ids else set()
