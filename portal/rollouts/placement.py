"""What a rollout checks before it starts the new version: the version is registered with release
hashes, the planner accepts it on the GPUs it will run on, and those GPUs are free. Where they are
not, the ways to free them are offered (docs/decisions.md, "Rollouts: what a start checks")."""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass

from django.conf import settings

from portal.core.errors import ApplicationError
from portal.deployments.models import Deployment, DeploymentEvent, DeploymentState, DesiredState, EventStatus
from portal.deployments.placement import gpu_health_problems, team_quota_problems
from portal.deployments.selectors import gpus_held_on_node
from portal.deployments.services import deployment_check
from portal.registry.models import ModelVersion


class GpuChoice(enum.StrEnum):
    TAKE_REPLICA = "take_replica"  # stop one replica of several of the old version; no downtime
    IN_PLACE = "in_place"  # stop the old version's only replica and start the new one on its GPUs


@dataclass(frozen=True)
class FreeingOption:
    """One way to free the GPUs the new deployment needs, offered to the operator."""

    choice: GpuChoice
    deployment: str  # the deployment that would be stopped to free them
    message: str
    downtime_s: int | None = None  # only for an in-place swap: how long the name serves nothing

    def as_dict(self) -> dict:
        return {**asdict(self), "choice": str(self.choice)}


def check_release(version: ModelVersion, deployment: Deployment | None = None) -> None:
    """A rollout only moves traffic to a version whose files are pinned by release hashes: the
    agent checks the files against them before it starts the server."""
    if version.external:
        raise ApplicationError(
            f"`{version.name}` was recorded from a running server: register it with its files and "
            "release hashes to roll it out.",
            field="to_deployment",
        )
    if version.simulated_release_at is not None and not version.weights_sha256:
        if deployment is not None and deployment.effective_engine == "sim":
            return  # release-checked for simulated nodes only, and this is one
        raise ApplicationError(
            f"`{version.name}` is release-checked for simulated nodes only; "
            f"{deployment.name if deployment is not None else 'this deployment'} runs a real engine: "
            "hash its files first (the Hash files button on its model version page).",
            field="to_deployment",
        )
    missing = [
        what
        for what, digest in (("weights", version.weights_sha256), ("tokenizer", version.tokenizer_sha256))
        if not digest
    ]
    if missing:
        raise ApplicationError(
            f"`{version.name}` has no release hashes for its {' and '.join(missing)}: hash its files "
            "first (the Hash files button on its model version page, or `manage.py hash_model <dir> "
            f"--model {version.name}`), so the start can verify them.",
            field="to_deployment",
        )


def check_plan(deployment: Deployment) -> None:
    """The planner on the GPUs the new deployment will run on (a CPU node has none to plan)."""
    if deployment.node is None or deployment.profile is None:
        raise ApplicationError(
            f"{deployment.name} names no node or profile to start on.", field="to_deployment"
        )
    deployment_check(
        team=deployment.team,
        model_version=deployment.model_version,
        profile=deployment.profile,
        node=deployment.node,
        gpu_indices=list(deployment.gpu_indices or []),
        desired_state=DesiredState.STOPPED,  # the planner only: whether the GPUs are free is ours
    )


def _last_start_s(deployment: Deployment) -> float | None:
    """How long the last measured start (request → serving) of this deployment, else of any of its
    version's deployments, took."""
    events = DeploymentEvent.objects.filter(step="serving", status=EventStatus.OK, seconds__isnull=False)
    for scope in (
        events.filter(deployment=deployment),
        events.filter(deployment__model_version_id=deployment.model_version_id),
    ):
        last = scope.order_by("-at").values_list("seconds", flat=True).first()
        if last is not None:
            return last
    return None


def in_place_downtime_s(deployment: Deployment) -> int | None:
    """Draining the old server (at most DEPLOYMENT_DRAIN_TIMEOUT_S) plus the new one's start."""
    start = _last_start_s(deployment)
    return None if start is None else round(settings.DEPLOYMENT_DRAIN_TIMEOUT_S + start)


def freeing_options(*, deployment: Deployment, from_version: ModelVersion) -> list[FreeingOption]:
    """The ways to free the GPUs `deployment` needs, when the old version holds them."""
    needed = set(deployment.gpu_indices or [])
    held = gpus_held_on_node(deployment.placed_node, exclude_deployment_id=deployment.pk)
    holders = {held[i] for i in needed if i in held}
    if len(holders) != 1:
        return []  # several deployments (or none) hold them: no single stop frees them
    holder = Deployment.objects.get(name=holders.pop())
    if holder.model_version_id != from_version.pk or holder.adopted:
        return []  # another version's GPUs are not the rollout's to take
    replicas = Deployment.objects.filter(
        model_version_id=from_version.pk, desired_state=DesiredState.RUNNING, state=DeploymentState.SERVING
    ).count()
    if replicas > 1:
        return [
            FreeingOption(
                GpuChoice.TAKE_REPLICA,
                holder.name,
                f"take {holder.name} out of the pool: {from_version.name} keeps {replicas - 1} of its "
                f"{replicas} replicas while the new version takes its GPUs; started again on a roll-back",
            )
        ]
    downtime = in_place_downtime_s(deployment)
    said = (
        f"about {downtime} s (draining {holder.name}, at most {settings.DEPLOYMENT_DRAIN_TIMEOUT_S} s, "
        f"then starting {deployment.name} as long as its last start took)"
        if downtime is not None
        else "for as long as the new deployment takes to start (never measured yet)"
    )
    return [
        FreeingOption(
            GpuChoice.IN_PLACE,
            holder.name,
            f"swap in place: stop {holder.name} and start {deployment.name} on its GPUs; the name serves "
            f"nothing {said}; a roll-back starts {holder.name} again",
            downtime_s=downtime,
        )
    ]


def check_gpus(
    *, deployment: Deployment, from_version: ModelVersion, choice: str = ""
) -> FreeingOption | None:
    """Refuse a start on GPUs that are not free, offering the ways to free them; with one of them
    chosen, return it (the caller stops its deployment before starting the new one)."""
    if deployment.desired_state == DesiredState.RUNNING or deployment.node is None:
        return None  # it holds its GPUs already
    gpu_indices = list(deployment.gpu_indices or [])
    for problems in (
        gpu_health_problems(node=deployment.node, gpu_indices=gpu_indices),
        team_quota_problems(
            team=deployment.team, gpu_count=len(gpu_indices), exclude_deployment_id=deployment.pk
        ),
    ):
        if problems:
            raise ApplicationError(problems[0].message, field="to_deployment")
    held = gpus_held_on_node(deployment.node, exclude_deployment_id=deployment.pk)
    taken = {i: held[i] for i in gpu_indices if i in held}
    if not taken:
        return None
    options = freeing_options(deployment=deployment, from_version=from_version)
    chosen = next((o for o in options if o.choice == choice), None)
    if chosen is not None:
        return chosen
    listing = ", ".join(f"GPU {i} ({name})" for i, name in sorted(taken.items()))
    message = f"No free GPUs for {deployment.name} on {deployment.node.name}: {listing} held."
    message += (
        " Choose: " + " Or: ".join(o.message + "." for o in options)
        if options
        else " Free them, or choose a deployment on free GPUs."
    )
    raise ApplicationError(
        message,
        field="gpu_choice" if options else "to_deployment",
        extra={"no_free_gpus": True, "choices": [o.as_dict() for o in options]},
    )


@dataclass(frozen=True)
class Hardware:
    """What a deployment runs on, as far as a latency comparison between two versions is concerned."""

    gpu_kind: str  # the GPUs' names as the node reports them (else the profile's target); "" unknown
    gpu_count: int
    tensor_parallel_size: int

    def describe(self) -> str:
        kind = self.gpu_kind or "unknown GPU"
        return f"{self.gpu_count} × {kind}, TP {self.tensor_parallel_size}"


def hardware_of(deployment: Deployment) -> Hardware:
    """0 GPUs or TP 0: unknown (an adopted engine has neither a node nor a profile)."""
    node, profile = deployment.node, deployment.profile
    names = (
        sorted(set(node.gpus.filter(index__in=deployment.gpu_indices).values_list("name", flat=True)))
        if node is not None
        else []
    )
    kind = ", ".join(names) or (profile.target_gpu_name if profile is not None else "")
    return Hardware(
        gpu_kind=kind,
        gpu_count=deployment.gpu_count or (profile.target_gpu_count if profile is not None else 0),
        tensor_parallel_size=profile.tensor_parallel_size if profile is not None else 0,
    )


def old_deployment_of(*, from_deployment: Deployment | None, from_version: ModelVersion) -> Deployment | None:
    """The deployment the new version is compared with: the one named, else one running the old version."""
    if from_deployment is not None:
        return from_deployment
    return (
        Deployment.objects.filter(model_version=from_version, state=DeploymentState.SERVING)
        .select_related("node", "profile")
        .order_by("pk")
        .first()
    )


def hardware_warning(*, old: Deployment | None, new: Deployment) -> str:
    """Why comparing the two versions' latencies would judge the hardware, not the version ("" if
    the GPU kind, count and tensor-parallel size are the same, or the old one is unknown)."""
    if old is None:
        return ""
    mine, theirs = hardware_of(new), hardware_of(old)
    differs = []
    if mine.gpu_kind and theirs.gpu_kind and mine.gpu_kind != theirs.gpu_kind:
        differs.append("GPU kind")
    if mine.gpu_count and theirs.gpu_count and mine.gpu_count != theirs.gpu_count:
        differs.append("GPU count")
    if (
        mine.tensor_parallel_size
        and theirs.tensor_parallel_size
        and (mine.tensor_parallel_size != theirs.tensor_parallel_size)
    ):
        differs.append("tensor-parallel size")
    if not differs:
        return ""
    return (
        f"{new.name} runs on other hardware than {old.name} ({', '.join(differs)}: "
        f"{mine.describe()} against {theirs.describe()}): its latencies will differ whatever the "
        "version; consider comparing against the SLA only"
    )
