"""REST API for benchmark runs: list, read (the export shape), start, cancel, apply the SLA cap."""

from __future__ import annotations

from typing import Any

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema, inline_serializer
from rest_framework import serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import NotFound, PermissionDenied
from rest_framework.permissions import IsAuthenticated
from rest_framework.response import Response

from inference.loadgen.workloads import MAX_INLINE_CHARS
from portal.core.api import StaffOnlyFieldsMixin
from portal.deployments.selectors import deployments_visible_to

from . import services
from .filters import BenchmarkRunFilter
from .models import BenchmarkRun
from .selectors import redact_text, run_export, runs_visible_to
from .services import (
    MAX_CONCURRENCY,
    MAX_LEVEL_S,
    MAX_LEVELS,
    MAX_REQUEST_RATE,
    MAX_REQUESTS_PER_LEVEL,
    MAX_SEED,
)


class RunListSerializer(StaffOnlyFieldsMixin, serializers.ModelSerializer):
    staff_only_fields = ("endpoint_url",)

    # Null for an imported table or a bare endpoint (and after the deployment is deleted).
    deployment: serializers.SlugRelatedField[Any] = serializers.SlugRelatedField(
        slug_field="name", read_only=True, allow_null=True
    )
    profile: serializers.SlugRelatedField[Any] = serializers.SlugRelatedField(
        slug_field="name", read_only=True, allow_null=True
    )
    endpoint_url = serializers.CharField(
        read_only=True, help_text="Server root (no /v1); blank for an import. Staff only."
    )

    class Meta:
        model = BenchmarkRun
        fields = [
            "id",
            "kind",
            "title",
            "deployment",
            "profile",
            "endpoint_url",
            "model_name",
            "mix",
            "state",
            "state_reason",
            "progress",
            "sla_concurrency",
            "sla_reason",
            "created_at",
            "finished_at",
        ]

    def to_representation(self, instance):
        data = super().to_representation(instance)
        request = self.context.get("request")
        if request is None or not request.user.is_staff:
            # Where engines live is for staff only, in the reason as in `endpoint_url`.
            data["state_reason"] = redact_text(data["state_reason"])
        return data


class RunCreateSerializer(serializers.Serializer):
    deployment = serializers.CharField(required=False, allow_blank=True)
    endpoint_url = serializers.URLField(required=False, allow_blank=True)
    model_name = serializers.CharField(required=False, allow_blank=True)
    mix = serializers.CharField(
        default="field-mix",
        max_length=MAX_INLINE_CHARS,
        help_text="A preset, fixed:<in>:<out>, or an inline JSON mix; never a file path.",
    )
    # Bounds for everyone; non-staff users get the tighter BENCHMARK_MEMBER_* settings (the service).
    concurrencies = serializers.ListField(
        child=serializers.IntegerField(min_value=1, max_value=MAX_CONCURRENCY),
        required=False,
        max_length=MAX_LEVELS,
    )
    request_rates = serializers.ListField(
        child=serializers.FloatField(min_value=0.001, max_value=MAX_REQUEST_RATE),
        required=False,
        max_length=MAX_LEVELS,
    )
    requests_per_level = serializers.IntegerField(
        min_value=1, max_value=MAX_REQUESTS_PER_LEVEL, required=False, allow_null=True
    )
    duration_s = serializers.FloatField(min_value=0.1, max_value=MAX_LEVEL_S, required=False, allow_null=True)
    seed = serializers.IntegerField(default=0, min_value=0, max_value=MAX_SEED)
    level_timeout_s = serializers.FloatField(
        min_value=1, max_value=MAX_LEVEL_S, required=False, allow_null=True
    )
    title = serializers.CharField(required=False, allow_blank=True, max_length=200)


class BenchmarkRunViewSet(viewsets.ReadOnlyModelViewSet):
    """Runs you can see. Filters: ?deployment=&profile=&mix=&state=&kind= (BenchmarkRunFilter)."""

    filterset_class = BenchmarkRunFilter
    serializer_class = RunListSerializer
    permission_classes = [IsAuthenticated]
    queryset = BenchmarkRun.objects.none()  # for the schema; get_queryset scopes to the user

    def get_queryset(self):
        return runs_visible_to(self.request.user)

    @extend_schema(responses={200: OpenApiTypes.OBJECT}, description="The run in its JSON export shape.")
    def retrieve(self, request, *args, **kwargs):
        return Response(run_export(self.get_object(), staff=request.user.is_staff))

    @extend_schema(request=RunCreateSerializer, responses=RunListSerializer)
    def create(self, request):
        data = RunCreateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        values = dict(data.validated_data)
        deployment_name = values.pop("deployment", "")
        deployment = None
        if deployment_name:
            deployment = deployments_visible_to(request.user).filter(name=deployment_name).first()
            if deployment is None:
                raise NotFound(f"no deployment {deployment_name!r}")
        run_request = services.BenchmarkRunRequest(deployment=deployment, **values)
        run = services.benchmark_run_create(user=request.user, run_request=run_request)
        return Response(
            RunListSerializer(run, context={"request": request}).data, status=status.HTTP_201_CREATED
        )

    @extend_schema(request=None, responses=RunListSerializer)
    @action(detail=True, methods=["post"])
    def cancel(self, request, pk=None):
        run = self.get_object()
        if not (request.user.is_staff or run.created_by_id == request.user.pk):
            raise PermissionDenied("only staff or the run's creator may cancel it")
        run = services.benchmark_run_cancel(run=run)
        return Response(RunListSerializer(run, context={"request": request}).data)

    @extend_schema(
        request=None,
        responses=inline_serializer(
            "AppliedCap",
            {
                "deployment": serializers.CharField(),
                "concurrency_cap": serializers.IntegerField(allow_null=True),
                "source": serializers.CharField(),
            },
        ),
    )
    @action(detail=True, methods=["post"], url_path="apply-cap")
    def apply_cap(self, request, pk=None):
        run = self.get_object()
        deployment = services.benchmark_run_apply_sla_cap(run=run, user=request.user)
        return Response(
            {
                "deployment": deployment.name,
                "concurrency_cap": deployment.concurrency_cap,
                "source": deployment.concurrency_cap_source,
            }
        )
