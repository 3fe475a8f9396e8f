"""REST API for model versions, their bf16 → fp16 conversion jobs and served model names."""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.permissions import IsAdminUser
from rest_framework.response import Response

from portal.audit.api import AuditedModelViewSetMixin
from portal.core.errors import ApplicationError
from portal.inventory.models import Node

from .filters import ModelVersionFilter
from .models import ConversionJob, ModelVersion, ServedModel
from .selectors import model_version_source_for
from .services import (
    DERIVED_FIELDS,
    conversion_job_start,
    model_version_create,
    served_model_create,
    served_model_set_shares,
)

HASH_FIELDS = ("weights_sha256", "tokenizer_sha256", "weight_files", "tokenizer_files", "hashed_at")


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
            "callable_by_name",
            "created_at",
        ]
        read_only_fields = DERIVED_FIELDS

    def to_representation(self, instance: ModelVersion) -> dict:
        data = super().to_representation(instance)
        request = self.context.get("request")
        if request is not None:  # where an adopted engine listens: staff only (selectors)
            data["source"] = model_version_source_for(request.user, instance)
        return data

    def validate(self, attrs):
        # Release hashes are what a start checks the node's files against, so they come from the
        # files themselves (the version page's Hash files, `manage.py hash_model --model`); typed in
        # they were silently dropped (read-only), which left a version looking registered but unready.
        typed = [name for name in HASH_FIELDS if name in self.initial_data]
        if typed:
            raise serializers.ValidationError(
                {
                    name: "release hashes are recorded from the files, not sent: use the model version "
                    "page's Hash files button or `manage.py hash_model <dir> --model <name>`"
                    for name in typed
                }
            )
        return attrs

    def create(self, validated_data):
        return model_version_create(**validated_data)

    def update(self, instance, validated_data):
        if "config" in validated_data and validated_data["config"] != instance.config:
            raise serializers.ValidationError(
                {"config": "a model version's architecture is fixed; register a new version instead"}
            )
        return super().update(instance, validated_data)


class ConversionJobSerializer(serializers.ModelSerializer):
    # A field named `source` shadows Field.source for the checker only: DRF reads declared fields.
    source: serializers.SlugRelatedField[Any] = serializers.SlugRelatedField(  # type: ignore[assignment]
        slug_field="name", read_only=True
    )
    result: serializers.SlugRelatedField[Any] = serializers.SlugRelatedField(
        slug_field="name", read_only=True
    )
    node: serializers.SlugRelatedField[Any] = serializers.SlugRelatedField(slug_field="name", read_only=True)
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
    filterset_class = ModelVersionFilter
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


# --- Served model names ---------------------------------------------------------------------------


class SharesField(serializers.DictField):
    """{"chat-7b-v1": 70, "chat-7b-v2": 30}: percent per version, at most two decimals → basis points."""

    def __init__(self, **kwargs):
        super().__init__(child=serializers.DecimalField(max_digits=5, decimal_places=2), **kwargs)

    def to_internal_value(self, data) -> dict[str, int]:
        if isinstance(data, dict) and len(data) > 50:
            raise serializers.ValidationError("At most 50 versions.")
        return {name: int(share * 100) for name, share in super().to_internal_value(data).items()}


class ServedModelSerializer(serializers.ModelSerializer):
    shares_percent = serializers.SerializerMethodField(help_text="Each version's share of the traffic.")

    class Meta:
        model = ServedModel
        fields = ["id", "name", "description", "shares_percent", "created_at", "updated_at"]

    def get_shares_percent(self, served: ServedModel) -> dict[str, float]:
        return {row.model_version.name: row.share_bp / 100 for row in served.versions.all()}


class ServedModelCreateSerializer(serializers.Serializer):
    name = serializers.CharField(max_length=100)
    description = serializers.CharField(max_length=200, required=False, allow_blank=True)
    shares = SharesField(help_text="Percent per version name, adding up to 100.")


class SharesSerializer(serializers.Serializer):
    shares = SharesField(help_text="Percent per version name, adding up to 100 (versions left out leave).")


class ServedModelViewSet(viewsets.ReadOnlyModelViewSet):
    """Stable names clients call, each over model versions with traffic shares (docs/operators.md "Rollouts").
    Staff create them and set shares; a rollout moves the shares step by step."""

    serializer_class = ServedModelSerializer
    queryset = ServedModel.objects.prefetch_related("versions__model_version")
    lookup_field = "name"

    @extend_schema(request=ServedModelCreateSerializer, responses={201: ServedModelSerializer})
    def create(self, request):
        data = ServedModelCreateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        served = served_model_create(**data.validated_data, actor=request.user)
        return Response(ServedModelSerializer(self.get_queryset().get(pk=served.pk)).data, status=201)

    @extend_schema(request=SharesSerializer, responses={200: ServedModelSerializer})
    @action(detail=True, methods=["post"])
    def shares(self, request, name=None):
        """Set every version's share at once. A rollout in progress on this name sets its two versions'
        shares again at its next step: pause or end it first."""
        served = self.get_object()
        data = SharesSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        served_model_set_shares(
            served_model=served,
            shares=data.validated_data["shares"],
            actor=request.user,
            reason="set by hand",
        )
        return Response(ServedModelSerializer(self.get_queryset().get(pk=served.pk)).data)
