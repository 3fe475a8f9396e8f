"""REST API for model versions."""

from __future__ import annotations

from rest_framework import serializers, viewsets

from .models import ModelVersion
from .services import DERIVED_FIELDS, model_version_create


class ModelVersionSerializer(serializers.ModelSerializer):
    config = serializers.JSONField(help_text="The model's Hugging Face config.json; the facts come from it.")

    class Meta:
        model = ModelVersion
        fields = [
            "id",
            "name",
            "source",
            "revision",
            "path",
            "config",
            *DERIVED_FIELDS,
            "smoke_expected_substring",
            "created_at",
        ]
        read_only_fields = DERIVED_FIELDS

    def create(self, validated_data):
        return model_version_create(**validated_data)

    def update(self, instance, validated_data):
        if "config" in validated_data and validated_data["config"] != instance.config:
            raise serializers.ValidationError(
                {"config": "a model version's architecture is fixed; register a new version instead"}
            )
        return super().update(instance, validated_data)


class ModelVersionViewSet(viewsets.ModelViewSet):
    serializer_class = ModelVersionSerializer
    queryset = ModelVersion.objects.all()
    lookup_field = "name"
    lookup_value_regex = "[^/]+"  # model names keep their dots
