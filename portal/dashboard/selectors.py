"""Reads for the front page: the ops dashboard (staff) and the team front page (members).

Each read is a fixed number of queries whatever the number of nodes, deployments,
teams or keys (the tests bound them), plus one Redis pipeline for live figures.
"""

from __future__ import annotations

import datetime as dt
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import redis
from django.db.models import Count, F, Max, Q, Sum
from django.utils import timezone

from portal.benchmarks.models import BenchmarkRun
from portal.core.redis.client import redis_keys
from portal.deployments.models import Deployment, DeploymentState, MetricsSample
from portal.deployments.selectors import (
    CallableModel,
    callable_names,
    gpus_held_per_node,
    models_callable_by,
    served_replicas,
)
from portal.inventory.models import Gpu, Node
from portal.inventory.selectors import gpus_not_healthy, node_list
from portal.observability import prometheus
from portal.teams.models import BILLED, ApiKey, Team, Usage, UsageStatus


@dataclass
class NodeOccupancy:
    node: Node
    gpus: int
    held: int
    gpu_name: str

    @property
    def share(self) -> float:
        return self.held / self.gpus if self.gpus else 0.0


def node_occupancy() -> list[NodeOccupancy]:
    """GPUs held by deployments that should be running, per node (3 queries)."""
    held = gpus_held_per_node()
    out = []
    for node in node_list():
        gpus = list(node.gpus.all())  # prefetched
        out.append(NodeOccupancy(node, len(gpus), len(held.get(node.pk, ())), gpus[0].name if gpus else ""))
    return out


@dataclass
class DeploymentHealth:
    deployment: Deployment
    sample: MetricsSample | None
    in_flight: int | None

    @property
    def health(self) -> str:
        """ok / failing / unknown, from the last supervision sample of a serving deployment."""
        if self.deployment.state != DeploymentState.SERVING:
            return ""
        if self.sample is None:
            return "unknown"
        return "ok" if self.sample.healthy else "failing"


def _live_slots(key_for: Callable[[int], str], ids: list[int]) -> dict[int, int] | None:
    """Unexpired gateway slots per id (one pipelined ZCOUNT each); None when Redis is unreachable."""
    if not ids:
        return {}
    now_ms = int(time.time() * 1000)
    try:
        with prometheus.client().pipeline(transaction=False) as pipe:
            for pk in ids:
                pipe.zcount(key_for(pk), now_ms, "+inf")
            return dict(zip(ids, pipe.execute(), strict=True))
    except redis.RedisError:
        return None


def _in_flight(deployment_ids: list[int]) -> dict[int, int] | None:
    return _live_slots(redis_keys().inflight, deployment_ids)


def deployment_health(deployments) -> list[DeploymentHealth]:
    """Each deployment with its last supervision sample and gateway requests in flight (3 queries)."""
    deployments = list(deployments)
    last_ids = (
        MetricsSample.objects.filter(deployment__in=[d.pk for d in deployments])
        .values("deployment_id")
        .annotate(last=Max("id"))
        .values_list("last", flat=True)
    )
    samples = {s.deployment_id: s for s in MetricsSample.objects.filter(id__in=list(last_ids))}
    serving = [d.pk for d in deployments if d.state == DeploymentState.SERVING]
    in_flight = _in_flight(serving) or {}
    return [DeploymentHealth(d, samples.get(d.pk), in_flight.get(d.pk)) for d in deployments]


def recent_benchmark_runs(*, limit: int = 8) -> list[BenchmarkRun]:
    return list(
        BenchmarkRun.objects.select_related("deployment", "profile")
        .annotate(level_count=Count("levels"))
        .order_by("-created_at", "-id")[:limit]
    )


# --- the team front page ------------------------------------------------------------


@dataclass(frozen=True)
class ModelToCall:
    """A model on the team front page, with the max_tokens its requests get."""

    model: CallableModel
    max_tokens: int  # a request's default and largest max_tokens (less its prompt if context_bound)
    context_bound: bool  # the context, not the team's clamp, bounds max_tokens


@dataclass(frozen=True)
class VersionServed:
    """How many of a team's requests to a model name one version answered (last 24 h)."""

    model: str  # the name the requests called (a served name shows one row per version)
    version: str
    requests: int


@dataclass
class TeamFront:
    team: Team
    models: list[ModelToCall]  # what the team's keys can call now, with their contexts
    keys: list[ApiKey]
    requests_today: int
    tokens_today: int
    failed_today: int
    in_flight: int | None
    served_by: list[VersionServed] = field(default_factory=list)  # busiest name first, then version


def team_fronts(user) -> list[TeamFront]:
    """For each of the user's teams (never another's): callable models, keys, quotas, usage today.
    Five queries and one Redis pipeline, whatever the number of teams and keys."""
    teams = list(Team.objects.filter(members=user).order_by("name"))
    if not teams:
        return []
    replicas = served_replicas()
    keys: dict[int, list[ApiKey]] = defaultdict(list)
    # Live keys first (PostgreSQL sorts NULLs last by default), newest first.
    for key in ApiKey.objects.filter(
        team__in=teams, playground_user__isnull=True, benchmark_user__isnull=True
    ).order_by(F("revoked_at").asc(nulls_first=True), "-created_at"):
        keys[key.team_id].append(key)
    midnight = timezone.now().replace(hour=0, minute=0, second=0, microsecond=0)
    usage = {
        row["team_id"]: row
        for row in Usage.objects.filter(team__in=teams, created_at__gte=midnight)
        .values("team_id")
        .annotate(
            requests=Count("id"),
            prompt=Sum("prompt_tokens", filter=BILLED),  # a refused prompt ran nowhere
            completion=Sum("completion_tokens", filter=BILLED),
            failed=Count("id", filter=~Q(status__in=[UsageStatus.COMPLETED, UsageStatus.REJECTED])),
        )
    }
    served_by = _versions_served(teams)
    in_flight = _team_in_flight([t.pk for t in teams])
    out = []
    names = callable_names()
    for team in teams:
        clamp = team.max_tokens_clamp
        callable_models = models_callable_by(team, replicas, names)
        models = [ModelToCall(m, m.max_tokens(clamp), m.context_bound(clamp)) for m in callable_models]
        row = usage.get(team.pk, {})
        out.append(
            TeamFront(
                team=team,
                models=models,
                keys=keys[team.pk],
                requests_today=row.get("requests", 0),
                tokens_today=(row.get("prompt") or 0) + (row.get("completion") or 0),
                failed_today=row.get("failed", 0),
                in_flight=None if in_flight is None else in_flight[team.pk],
                served_by=served_by[team.pk],
            )
        )
    return out


def _versions_served(teams: list[Team]) -> dict[int, list[VersionServed]]:
    """Per team, the versions that answered its requests in the last 24 hours, per name called
    (issue 37: a member sees which version of a served name served them). One query; the version
    is the recorded deployment's, so requests that reached no deployment are left out."""
    since = timezone.now() - dt.timedelta(hours=24)
    out: dict[int, list[VersionServed]] = defaultdict(list)
    rows = (
        Usage.objects.filter(team__in=teams, created_at__gte=since, deployment__isnull=False)
        .values("team_id", "model", "deployment__model_version__name")
        .annotate(requests=Count("id"))
        .order_by("team_id", "model", "-requests", "deployment__model_version__name")
    )
    for row in rows:
        out[row["team_id"]].append(
            VersionServed(row["model"], row["deployment__model_version__name"], row["requests"])
        )
    return out


def _team_in_flight(team_ids: list[int]) -> dict[int, int] | None:
    return _live_slots(lambda pk: redis_keys().concurrency("team", pk), team_ids)


@dataclass
class SickGpu:
    gpu: Gpu
    holder: str  # the deployment holding it, "" when free


def gpus_not_healthy_with_holders() -> list[SickGpu]:
    """The GPUs not healthy, worst first, each with the deployment holding it (two queries at most)."""
    gpus = list(gpus_not_healthy())
    if not gpus:
        return []
    holders: dict[tuple[int, int], str] = {}
    held = Deployment.objects.filter(desired_state="running", node__in={g.node_id for g in gpus})
    for node_id, name, indices in held.values_list("node_id", "name", "gpu_indices"):
        for index in indices or []:
            holders[(node_id, index)] = name
    return [SickGpu(gpu, holders.get((gpu.node_id, gpu.index), "")) for gpu in gpus]
