"""A served model `chat` at 100 % on an old version's serving deployment, and a new version's
deployment beside it (tests/rollouts)."""

from __future__ import annotations

import datetime as dt
import uuid
from dataclasses import dataclass

import pytest


@dataclass
class Pair:
    served: object
    old: object  # the old version's deployment
    new: object  # the new version's deployment


def deployment_of(*, team, node, name: str, state: str = "serving"):
    from portal.deployments.models import Deployment, DeploymentProfile
    from portal.registry.services import model_version_create
    from tests.helpers.samples import bundled_config

    version = model_version_create(name=name, config=bundled_config("llama-2-7b-chat-hf"))
    profile = DeploymentProfile.objects.create(name=f"p-{name}", model_version=version)
    return Deployment.objects.create(
        name=f"d-{name}",
        team=team,
        model_version=version,
        profile=profile,
        node=node,
        desired_state="running",
        state=state,
        endpoint_url="http://127.0.0.1:9" if state == "serving" else "",
    )


def make_pair(*, team, node, new_state: str = "serving") -> Pair:
    from portal.registry.services import served_model_create

    tag = uuid.uuid4().hex[:6]
    old = deployment_of(team=team, node=node, name=f"chat-v1-{tag}")
    new = deployment_of(team=team, node=node, name=f"chat-v2-{tag}", state=new_state)
    served = served_model_create(name=f"chat-{tag}", shares={old.model_version.name: 10_000})
    return Pair(served, old, new)


@pytest.fixture
def pair(db, team, cpu_node) -> Pair:
    return make_pair(team=team, node=cpu_node)


def measured(deployment, minute: dt.datetime, *, requests: int = 50, errors: int = 0,
             ttft_ms: float = 400.0, tpot_ms: float = 40.0):  # fmt: skip
    """A gateway latency rollup row, as `latency_rollup` would have written it."""
    from portal.observability.models import LatencyMinute

    return LatencyMinute.objects.update_or_create(
        deployment=deployment,
        minute=minute.replace(second=0, microsecond=0),
        defaults=dict(requests=requests, errors=errors, p95_ttft_ms=ttft_ms, p95_tpot_ms=tpot_ms),
    )[0]


def shares_of(served) -> dict[str, int]:
    return dict(served.versions.values_list("model_version__name", "share_bp"))
