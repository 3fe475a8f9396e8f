"""The benchmark run list's filters (`/benchmarks/`, `/api/v1/benchmark-runs/`)."""

from __future__ import annotations

import django_filters
from django.db.models import Q

from portal.core.filters import NAME_FILTER_MAX_LENGTH

from .models import BenchmarkRun, RunKind, RunState


class BenchmarkRunFilter(django_filters.FilterSet):
    # By name, through the snapshot too: a run outlives its deployment and its profile.
    deployment = django_filters.CharFilter(method="filter_deployment", max_length=NAME_FILTER_MAX_LENGTH)
    profile = django_filters.CharFilter(method="filter_profile", max_length=NAME_FILTER_MAX_LENGTH)
    mix = django_filters.CharFilter(max_length=BenchmarkRun._meta.get_field("mix").max_length)
    state = django_filters.ChoiceFilter(choices=RunState.choices)
    kind = django_filters.ChoiceFilter(choices=RunKind.choices)

    class Meta:
        model = BenchmarkRun
        fields = ["deployment", "profile", "mix", "state", "kind"]

    def filter_deployment(self, queryset, name, value):
        return queryset.filter(Q(deployment__name=value) | Q(snapshot__deployment=value))

    def filter_profile(self, queryset, name, value):
        return queryset.filter(Q(profile__name=value) | Q(snapshot__profile__name=value))
