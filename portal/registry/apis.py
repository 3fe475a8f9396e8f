"""REST API for model versions and their bf16 → fp16 conversion jobs."""

from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.permissions import IsAdminUser
from rest_framework.response import Response

from portal.audit.api import AuditedModelViewSetMixin
from portal.core.errors import ApplicationError
from portal.inventory.models import Node

from .models import ConversionJob, ModelVersion
from .services import DERIVED_FIELDS, conversion_job_start, model_version_create


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


class ConversionJobSerializer(serializers.ModelSerializer):
    source = serializers.SlugRelatedField(slug_field="name", read_only=True)
    result = serializers.SlugRelatedField(slug_field="name", read_only=True)
    node = serializers.SlugRelatedField(slug_field="name", read_only=True)
    percent = serializers.FloatField(read_only=True)
    stale = serializers.BooleanField(source="is_stale", read_only=True)

    class Meta:
        model = ConversionJob
        fields = [
            "id",
            "source",
            "new_name",
            "output_path",
            "node",
            "clamp",
            "state",
            "phase",
            "stale",
            "percent",
            "tensors_done",
            "tensors_total",
            "bytes_done",
            "bytes_total",
            "current_file",
            "overflow_total",
            "overflows",
            "nonfinite_total",
            "underflow_total",
            "report",
            "error",
            "result",
            "created_at",
            "started_at",
            "finished_at",
            "updated_at",
        ]
        read_only_fields = fields


class ConvertRequestSerializer(serializers.Serializer):
    node = serializers.SlugRelatedField(
        slug_field="name",
        queryset=Node.objects.all(),
        required=False,
        help_text="The node holding the files, whose agent runs the job (default: the only node, if one).",
    )
    name = serializers.CharField(
        required=False, default="", help_text="New version's name (default <name>-fp16)."
    )
    clamp = serializers.BooleanField(
        required=False, default=False, help_text="Clamp to ±65504 instead of stopping."
    )


class ModelVersionViewSet(AuditedModelViewSetMixin, viewsets.ModelViewSet):
    serializer_class = ModelVersionSerializer
    queryset = ModelVersion.objects.all()
    lookup_field = "name"
    lookup_value_regex = "[^/]+"  # model names keep their dots

    @extend_schema(request=ConvertRequestSerializer, responses={202: ConversionJobSerializer})
    @action(detail=True, methods=["post"], url_path="convert-fp16", permission_classes=[IsAdminUser])
    def convert_fp16(self, request, name=None):
        """Start a bf16 → fp16 conversion on the node holding the files (staff only)."""
        version = self.get_object()
        data = ConvertRequestSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        node = data.validated_data.get("node") or _only_node()
        job = conversion_job_start(
            model_version=version,
            node=node,
            new_name=data.validated_data["name"],
            clamp=data.validated_data["clamp"],
            requested_by=request.user,
        )
        return Response(ConversionJobSerializer(job).data, status=status.HTTP_202_ACCEPTED)


def _only_node() -> Node:
    nodes = list(Node.objects.all()[:2])
    if len(nodes) != 1:
        raise ApplicationError("which node holds the files? name it", field="node")
    return nodes[0]


class ConversionJobViewSet(viewsets.ReadOnlyModelViewSet):
    """bf16 → fp16 conversion jobs, newest first, with live progress."""

    serializer_class = ConversionJobSerializer
    queryset = ConversionJob.objects.select_related("source", "result", "node")
