"""The node and GPU lists' filters (`/nodes/`, `/api/v1/nodes/`, `/api/v1/gpus/`)."""

from __future__ import annotations

import django_filters

from inference.hardware import GPU_CATALOG
from portal.core.filters import ByNameFilter, IntegerFilter, NameContainsFilter

from .models import Gpu, GpuHealth, Interconnect, Node

ENGINES = Node._meta.get_field("engine").choices
CATALOG_CHOICES = [(key, spec.display_name) for key, spec in GPU_CATALOG.items()]


class NodeFilter(django_filters.FilterSet):
    name = NameContainsFilter()
    engine = django_filters.ChoiceFilter(choices=ENGINES)
    interconnect = django_filters.ChoiceFilter(choices=Interconnect.choices)
    gpu = django_filters.ChoiceFilter(
        field_name="gpus__catalog_key", choices=CATALOG_CHOICES, distinct=True, label="Has a GPU of kind"
    )

    class Meta:
        model = Node
        fields = ["name", "engine", "interconnect", "gpu"]


class GpuFilter(django_filters.FilterSet):
    node = ByNameFilter(queryset=Node.objects.all())
    catalog_key = django_filters.ChoiceFilter(choices=CATALOG_CHOICES, label="Kind")
    health_state = django_filters.ChoiceFilter(choices=GpuHealth.choices)
    index = IntegerFilter(min_value=0, max_value=255)

    class Meta:
        model = Gpu
        fields = ["node", "catalog_key", "health_state", "index"]
