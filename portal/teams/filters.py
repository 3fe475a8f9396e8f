"""The team list's filters (`/api/v1/teams/`)."""

from __future__ import annotations

import django_filters

from portal.core.filters import NameContainsFilter

from .models import PriorityClass, Team


class TeamFilter(django_filters.FilterSet):
    name = NameContainsFilter()
    priority_class = django_filters.ChoiceFilter(choices=PriorityClass.choices)

    class Meta:
        model = Team
        fields = ["name", "priority_class"]
