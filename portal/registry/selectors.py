"""Reads of the registry."""

from __future__ import annotations

from django.db.models import Q, QuerySet

from portal.inventory.models import ACCEPTANCE_SOURCE_PREFIX

from .models import ModelVersion


def acceptance_model_q(prefix: str = "") -> Q:
    """Model versions a node acceptance registered (its random-weight reference models);
    `prefix` is the lookup path to the model version from another model ("model_version__")."""
    return Q(**{f"{prefix}source__startswith": ACCEPTANCE_SOURCE_PREFIX})


def model_versions_listed(*, acceptance: bool = False) -> QuerySet[ModelVersion]:
    """The model list: without acceptance's reference models unless asked for (then only them)."""
    versions = ModelVersion.objects.all()
    return versions.filter(acceptance_model_q()) if acceptance else versions.exclude(acceptance_model_q())


# The `source` make_tiny_model (and `make run`'s demo) registers its generated models with.
TINY_MODEL_SOURCE = "make_tiny_model"


def random_weight_model_names(names: list[str]) -> list[str]:
    """Those of `names` whose weights are random (the demo's generated model, a node acceptance's
    reference models): they answer gibberish, which a person should be told (issue 38)."""
    random = Q(source=TINY_MODEL_SOURCE) | acceptance_model_q()
    return sorted(ModelVersion.objects.filter(random, name__in=names).values_list("name", flat=True))
