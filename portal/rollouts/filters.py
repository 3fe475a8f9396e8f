"""The rollout list's filters (`/rollouts/`, `/api/v1/rollouts/`)."""

from __future__ import annotations

import django_filters
from django.db.models import Q

from portal.core.filters import NAME_FILTER_MAX_LENGTH

from .models import Rollout, RolloutState


class RolloutFilter(django_filters.FilterSet):
    state = django_filters.ChoiceFilter(choices=RolloutState.choices)
    served_model = django_filters.CharFilter(
        field_name="served_model__name", max_length=NAME_FILTER_MAX_LENGTH, label="Served name"
    )
    deployment = django_filters.CharFilter(
        method="filter_deployment", max_length=NAME_FILTER_MAX_LENGTH,
        label="Deployment", help_text="A rollout from or to the deployment of this name.",
    )  # fmt: skip

    class Meta:
        model = Rollout
        fields = ["state", "served_model", "deployment"]

    def filter_deployment(self, queryset, name, value):
        return queryset.filter(Q(from_deployment__name=value) | Q(to_deployment__name=value))
