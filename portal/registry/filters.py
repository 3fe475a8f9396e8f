"""The model version list's filters (`/models/`, `/api/v1/model-versions/`)."""

from __future__ import annotations

import django_filters

from portal.core.filters import NameContainsFilter

from .models import ModelVersion, Quantization, WeightDtype


class ModelVersionFilter(django_filters.FilterSet):
    name = NameContainsFilter()
    model_type = django_filters.CharFilter(max_length=50, label="Architecture (model_type)")
    weight_dtype = django_filters.ChoiceFilter(choices=WeightDtype.choices)
    quantization = django_filters.ChoiceFilter(choices=Quantization.choices)
    external = django_filters.BooleanFilter(
        help_text="Recorded from a running server (register_endpoint) rather than from a config.json."
    )

    class Meta:
        model = ModelVersion
        fields = ["name", "model_type", "weight_dtype", "quantization", "external"]
