"""Reads of the registry."""

from __future__ import annotations

import re

from django.db.models import Q, QuerySet

from portal.inventory.models import ACCEPTANCE_SOURCE_PREFIX

from .models import ModelVersion, ServedModelVersion


def acceptance_model_q(prefix: str = "") -> Q:
    """Model versions a node acceptance registered (its random-weight reference models);
    `prefix` is the lookup path to the model version from another model ("model_version__")."""
    return Q(**{f"{prefix}source__startswith": ACCEPTANCE_SOURCE_PREFIX})


def model_versions_listed(*, acceptance: bool = False) -> QuerySet[ModelVersion]:
    """The model list: without acceptance's reference models unless asked for (then only them)."""
    versions = ModelVersion.objects.all()
    return versions.filter(acceptance_model_q()) if acceptance else versions.exclude(acceptance_model_q())


# A version recorded by `register_endpoint` keeps the adopted server's URL as its source: where an
# engine listens (another team's private one, perhaps) is for staff only, as on deployment pages.
_ENGINE_ADDRESS = re.compile(r"^\s*(?:https?|wss?)://", re.IGNORECASE)


def model_version_source_for(user, version: ModelVersion) -> str:
    """Where `version` came from, as `user` may read it: blank for a member when it is a server's URL."""
    if user.is_staff or not _ENGINE_ADDRESS.match(version.source or ""):
        return version.source
    return ""


def model_versions_shown_to(user, versions) -> list[ModelVersion]:
    """`versions` as `user` may read them, changed in memory only (never saved): see
    `model_version_source_for`."""
    shown = list(versions)
    for version in shown:
        version.source = model_version_source_for(user, version)
    return shown


def model_version_gateway_name(version: ModelVersion) -> str | None:
    """A name the gateway routes to `version`: its own, or (when it is callable only through
    served names) the first served name giving it a share; None when no name reaches it."""
    if version.callable_by_name:
        return version.name
    served = (
        ServedModelVersion.objects.filter(model_version=version, share_bp__gt=0)
        .order_by("served_model__name")
        .values_list("served_model__name", flat=True)
        .first()
    )
    return served


# The `source` make_tiny_model (and `make run`'s demo) registers its generated models with.
TINY_MODEL_SOURCE = "make_tiny_model"


def random_weight_model_names(names: list[str]) -> list[str]:
    """Those of `names` whose weights are random (the demo's generated model, a node acceptance's
    reference models): they answer gibberish, which a person should be told (issue 38)."""
    random = Q(source=TINY_MODEL_SOURCE) | acceptance_model_q()
    return sorted(ModelVersion.objects.filter(random, name__in=names).values_list("name", flat=True))
