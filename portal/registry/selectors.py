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
