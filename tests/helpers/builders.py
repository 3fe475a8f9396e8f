"""Builders for the rows most tests need: users, a team, nodes, model versions, profiles,
deployments and API keys — one place, so a new required field changes one function.

Call them through the module (`builders.team(...)`): their names are also fixture names.
Models are imported inside each builder: this module loads before Django is set up.
"""

from __future__ import annotations

import sys
import uuid

from django.utils import timezone

from tests.helpers.samples import bundled_config


def user(username: str, *, staff: bool = False, **fields):
    """A user whose password is `<username>-password`."""
    from django.contrib.auth import get_user_model

    return get_user_model().objects.create_user(
        username, password=f"{username}-password", is_staff=staff, **fields
    )


def team(name: str = "Search", *, slug: str | None = None, members=(), **fields):
    from django.utils.text import slugify

    from portal.teams.models import Team

    created = Team.objects.create(name=name, slug=slug or slugify(name), **fields)
    if members:
        created.members.add(*members)
    return created


def cpu_node_with(name: str, python: str = sys.executable):
    """A CPU node whose vLLM environment was already probed (the probe has its own tests)."""
    from portal.inventory.models import Node

    return Node.objects.create(
        name=name,
        hostname="127.0.0.1",
        vllm_python=python,
        vllm_version="0.32.0",
        torch_version="2.13.0+cpu",
        software_python=python,
        software_probed_at=timezone.now(),
    )


def model_version(name: str | None = None, *, config: str = "llama-2-7b-chat-hf", **fields):
    """A model version registered through the service, from a bundled config.json."""
    from portal.registry.services import model_version_create

    return model_version_create(
        name=name or f"m-{uuid.uuid4().hex[:8]}", config=bundled_config(config), **fields
    )


def profile(model_version=None, *, name: str | None = None, **fields):
    from portal.deployments.models import DeploymentProfile

    return DeploymentProfile.objects.create(
        name=name or f"p-{uuid.uuid4().hex[:8]}", model_version=model_version, **fields
    )


def deployment(*, name: str, team, model_version, node=None, profile=None, **fields):
    """A deployment row as given (state, endpoint, GPUs): no placement check, no audit event.
    `make_deployment` goes through `deployment_create` instead."""
    from portal.deployments.models import Deployment

    return Deployment.objects.create(
        name=name, team=team, model_version=model_version, node=node, profile=profile, **fields
    )


def serving_deployment(*, endpoint_url: str, cap: int | None = None, **fields):
    """A deployment row that is serving at `endpoint_url` (e.g. a fake upstream)."""
    return deployment(
        desired_state="running", state="serving", endpoint_url=endpoint_url, concurrency_cap=cap, **fields
    )


def make_deployment(
    team, version, profile, node, *, name: str = "tiny", desired_state: str = "running", gpus=()
):
    """A deployment created as the API creates one (placement, audit), not yet started."""
    from portal.deployments.services import deployment_create

    return deployment_create(
        name=name,
        team=team,
        model_version=version,
        profile=profile,
        node=node,
        gpu_indices=list(gpus),
        desired_state=desired_state,
    )


def make_serving_deployment(*, team, model, profile, node, url: str, name: str = "search-7b"):
    """A deployment created through the service on all 8 GPUs, then marked serving at `url`."""
    from portal.deployments.models import Deployment

    created = make_deployment(team, model, profile, node, name=name, gpus=range(8))
    Deployment.objects.filter(pk=created.pk).update(state="serving", endpoint_url=url)
    created.refresh_from_db()
    return created


def api_key(team, *, models=(), name: str = "tests", **fields):
    """(the key row, its token) through the service, allowed `models`."""
    from portal.teams.services import api_key_create

    return api_key_create(team=team, name=name, allowed_models=list(models), **fields)
