"""The team list's filters (`/api/v1/teams/`) and a team's key list's (its keys page)."""

from __future__ import annotations

import django_filters

from portal.core.filters import NameContainsFilter

from .models import ApiKey, PriorityClass, Team


class TeamFilter(django_filters.FilterSet):
    name = NameContainsFilter()
    priority_class = django_filters.ChoiceFilter(choices=PriorityClass.choices)

    class Meta:
        model = Team
        fields = ["name", "priority_class"]


class ApiKeyFilter(django_filters.FilterSet):
    """A team's key list (`/teams/<slug>/keys/`): by name, class, and whether revoked."""

    name = NameContainsFilter()
    priority_class = django_filters.ChoiceFilter(choices=PriorityClass.choices)
    revoked = django_filters.BooleanFilter(field_name="revoked_at", lookup_expr="isnull", exclude=True)

    class Meta:
        model = ApiKey
        fields = ["name", "priority_class", "revoked"]
