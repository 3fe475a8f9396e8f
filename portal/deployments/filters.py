"""The profile and deployment lists' filters (`/profiles/`, `/deployments/` and their APIs)."""

from __future__ import annotations

import django_filters

from inference.profile import DTYPES, MAX_TENSOR_PARALLEL
from portal.core.filters import ByNameFilter, IntegerFilter, NameContainsFilter, user_scoped
from portal.inventory.filters import CATALOG_CHOICES
from portal.inventory.models import Node
from portal.registry.models import ModelVersion
from portal.teams.models import Team
from portal.teams.selectors import teams_visible_to

from .models import Deployment, DeploymentProfile, DeploymentState, DesiredState


class ProfileFilter(django_filters.FilterSet):
    name = NameContainsFilter()
    model_version = ByNameFilter(queryset=ModelVersion.objects.all())
    target_gpu = django_filters.ChoiceFilter(choices=CATALOG_CHOICES)
    dtype = django_filters.ChoiceFilter(choices=[(d, d) for d in DTYPES])
    tensor_parallel_size = IntegerFilter(min_value=1, max_value=MAX_TENSOR_PARALLEL)
    enforce_eager = django_filters.BooleanFilter()

    class Meta:
        model = DeploymentProfile
        fields = ["name", "model_version", "target_gpu", "dtype", "tensor_parallel_size", "enforce_eager"]


class DeploymentFilter(django_filters.FilterSet):
    name = NameContainsFilter()
    state = django_filters.ChoiceFilter(choices=DeploymentState.choices)
    desired_state = django_filters.ChoiceFilter(choices=DesiredState.choices)
    # Only the teams the user belongs to (all, for staff): another team's slug is refused as unknown.
    team = ByNameFilter(queryset=user_scoped(teams_visible_to, Team), to_field_name="slug")
    node = ByNameFilter(queryset=Node.objects.all())
    profile = ByNameFilter(queryset=DeploymentProfile.objects.all())
    model_version = ByNameFilter(queryset=ModelVersion.objects.all())

    class Meta:
        model = Deployment
        fields = ["name", "state", "desired_state", "team", "node", "profile", "model_version"]
