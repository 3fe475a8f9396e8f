"""What every app's FilterSet builds on: bounded filters, and one way for a page to apply one.

Each app keeps its FilterSets in its own `filters.py`, one per model, used by its API viewset
(`filterset_class`, through DRF's DjangoFilterBackend: a bad value is a 400 naming the field) and
by its list page (`filtered`: a bad value is a form error beside the field, and an empty list).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import django_filters
from django import forms
from django.db.models import Model, QuerySet
from django.http import HttpRequest, QueryDict

# Longest text a name filter takes: every name field in the portal is at most this long.
NAME_FILTER_MAX_LENGTH = 200


class IntegerFilter(django_filters.NumberFilter):
    """A whole number within the field's bounds (NumberFilter's own field takes any decimal)."""

    field_class = forms.IntegerField


class NameContainsFilter(django_filters.CharFilter):
    """Part of a name, case-insensitive, at most NAME_FILTER_MAX_LENGTH characters."""

    def __init__(self, field_name: str = "name", **kwargs) -> None:
        kwargs.setdefault("lookup_expr", "icontains")
        kwargs.setdefault("max_length", NAME_FILTER_MAX_LENGTH)
        kwargs.setdefault("label", "Name contains")
        super().__init__(field_name=field_name, **kwargs)


class ByNameFilter(django_filters.ModelChoiceFilter):
    """One row named exactly (`to_field_name`, "name" unless told), typed into a text box: a list
    page's select would name every row, node acceptance's artefacts and all, however many."""

    def __init__(self, *, queryset, to_field_name: str = "name", **kwargs) -> None:
        kwargs.setdefault("widget", forms.TextInput)
        super().__init__(queryset=queryset, to_field_name=to_field_name, **kwargs)


def filtered(
    filterset_class: type[django_filters.FilterSet],
    request: HttpRequest,
    queryset: QuerySet,
    *,
    data: QueryDict | None = None,
) -> tuple[django_filters.FilterSet, QuerySet, int]:
    """(the bound FilterSet for the page's form, its rows, the page's status).

    A value the FilterSet refuses lists nothing and answers 400, its form showing why; unknown
    query parameters (the lists' own `?acceptance=show`) are not filters and are left alone.
    `data` replaces the query string (a page whose URL fixes a filter adds it there).
    """
    filterset = filterset_class(request.GET if data is None else data, queryset=queryset, request=request)
    # Its own element ids: a page may also hold a form with a field of the same name (a team's keys
    # page: the filter's and the new key's `priority_class`), and ids must be unique for the labels.
    filterset.form.auto_id = "id_filter_%s"
    if not filterset.is_valid():
        return filterset, queryset.none(), 400
    return filterset, filterset.qs, 200


def user_scoped(selector: Callable[[Any], QuerySet], model: type[Model]) -> Callable[[Any], QuerySet]:
    """A ModelChoiceFilter queryset of what the request's user may see (none without a signed-in
    user, as when the schema is generated), so a filter naming another team's object is refused
    like an unknown one and tells nothing about it."""

    def queryset(request: HttpRequest | None) -> QuerySet:
        user = getattr(request, "user", None)
        if user is None or not user.is_authenticated:
            return model._default_manager.none()
        return selector(user)

    return queryset
