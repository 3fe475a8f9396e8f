"""Whether a deployment may hold its GPUs: free on the node, and within its team's GPU quota.

The checks return problems rather than raise, so each caller says them its own way: the services
raise the first as an `ApplicationError` for the user (a 400 naming the field, an inline message),
and the node agent records it as the failed `quota` step of a start (the placement is checked
again there, since the GPUs may have been taken between the request and the start). The counts
come from the "GPUs held" selectors (`selectors.gpus_held_*`), the one definition of held.
"""

from __future__ import annotations

from dataclasses import dataclass

from inference.gpu_health import SICK_STATES
from portal.inventory.models import Node
from portal.teams.models import Team

from .selectors import gpus_held_by_team, gpus_held_on_node


@dataclass(frozen=True)
class PlacementProblem:
    code: str  # "gpus_taken" | "gpu_unhealthy" | "quota": the failure code a refused start records
    message: str
    field: str  # the input a user would change: "gpu_indices" | "team"


def gpus_taken_problems(
    *, node: Node, gpu_indices: list[int], exclude_deployment_id: int | None = None
) -> list[PlacementProblem]:
    held = gpus_held_on_node(node, exclude_deployment_id=exclude_deployment_id)
    taken = {i: held[i] for i in gpu_indices if i in held}
    if not taken:
        return []
    listing = ", ".join(f"GPU {i} ({name})" for i, name in sorted(taken.items()))
    message = f"already held by another running deployment: {listing}"
    return [PlacementProblem("gpus_taken", message, "gpu_indices")]


def gpu_health_problems(*, node: Node, gpu_indices: list[int]) -> list[PlacementProblem]:
    """A degraded or lost GPU takes no new deployment: its memory or its bus cannot be trusted."""
    sick = node.gpus.filter(index__in=gpu_indices, health_state__in=SICK_STATES).order_by("index")
    reasons = []
    for gpu in sick:
        worst = next((f["message"] for f in gpu.health_findings if f.get("level") == gpu.health_state), "")
        reasons.append(f"GPU {gpu.index} is {gpu.health_state}" + (f" ({worst})" if worst else ""))
    if not reasons:
        return []
    message = "; ".join(reasons) + " Choose other GPUs, or have staff mark it healthy after a reset."
    return [PlacementProblem("gpu_unhealthy", message, "gpu_indices")]


def team_quota_problems(
    *, team: Team, gpu_count: int, exclude_deployment_id: int | None = None
) -> list[PlacementProblem]:
    held = gpus_held_by_team(team, exclude_deployment_id=exclude_deployment_id)
    if held + gpu_count <= team.gpu_quota:
        return []
    message = (
        f"team {team.slug} holds {held} of its {team.gpu_quota} GPUs; this deployment needs {gpu_count} more"
    )
    return [PlacementProblem("quota", message, "team")]


def holding_problems(
    *, team: Team, node: Node, gpu_indices: list[int], exclude_deployment_id: int | None = None
) -> list[PlacementProblem]:
    """Everything that stops a deployment from holding `gpu_indices` of `node` now."""
    excluded = exclude_deployment_id
    return [
        *gpus_taken_problems(node=node, gpu_indices=gpu_indices, exclude_deployment_id=excluded),
        *gpu_health_problems(node=node, gpu_indices=gpu_indices),
        *team_quota_problems(team=team, gpu_count=len(gpu_indices), exclude_deployment_id=excluded),
    ]
