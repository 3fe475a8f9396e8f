"""REST API for deployment profiles, deployments and the capacity planner."""

from __future__ import annotations

from dataclasses import fields as dataclass_fields

from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.permissions import IsAuthenticated
from rest_framework.response import Response
from rest_framework.views import APIView

from inference.errors import InputError
from inference.hardware import get_gpu
from inference.profile import ProfileSettings, knob_type, launch_knobs
from portal.audit.api import AuditedModelViewSetMixin
from portal.core.api import ModelCleanMixin, StaffOnlyFieldsMixin
from portal.core.errors import ApplicationError
from portal.inventory.models import Node
from portal.registry.models import ModelVersion
from portal.teams import apis as teams_apis
from portal.teams.models import Team

from . import services
from .filters import DeploymentFilter, ProfileFilter
from .models import (
    Deployment,
    DeploymentEvent,
    DeploymentProfile,
    DeploymentState,
    DesiredState,
    MetricsSample,
)
from .selectors import deployment_text_for, deployments_visible_to, gpus_held_by_team


def _plan_dict(plan) -> dict | None:
    return plan.to_dict() if plan is not None else None


class ProfileSerializer(ModelCleanMixin, serializers.ModelSerializer):
    model_version = serializers.SlugRelatedField(
        slug_field="name", queryset=ModelVersion.objects.all(), required=False, allow_null=True
    )
    plan = serializers.SerializerMethodField(help_text="The planner's verdict against the profile's target.")

    class Meta:
        model = DeploymentProfile
        fields = [
            "id",
            "name",
            "description",
            "model_version",
            "target_gpu",
            "target_gpu_count",
            *(f.name for f in dataclass_fields(ProfileSettings)),
            "extra_args",
            "plan",
            "created_at",
            "updated_at",
        ]

    def validate_target_gpu(self, value: str) -> str:
        try:
            return get_gpu(value).key if value else value
        except InputError as error:
            raise serializers.ValidationError(error.message) from error

    def get_plan(self, profile: DeploymentProfile) -> dict | None:
        try:
            return _plan_dict(services.profile_plan(profile))
        except ApplicationError:
            return None


class ProfileViewSet(AuditedModelViewSetMixin, viewsets.ModelViewSet):
    filterset_class = ProfileFilter
    serializer_class = ProfileSerializer
    queryset = DeploymentProfile.objects.select_related("model_version")
    lookup_field = "name"


class DeploymentSerializer(StaffOnlyFieldsMixin, serializers.ModelSerializer):
    staff_only_fields = ("endpoint_url", "port", "pid", "command_line")

    team = serializers.SlugRelatedField(slug_field="slug", queryset=Team.objects.all())
    model_version = serializers.SlugRelatedField(slug_field="name", queryset=ModelVersion.objects.all())
    profile = serializers.SlugRelatedField(slug_field="name", queryset=DeploymentProfile.objects.all())
    node = serializers.SlugRelatedField(slug_field="name", queryset=Node.objects.all())
    gpu_indices = serializers.ListField(child=serializers.IntegerField(min_value=0), max_length=64)
    desired_state = serializers.ChoiceField(choices=DesiredState.choices, default=DesiredState.RUNNING)
    state = serializers.ChoiceField(choices=DeploymentState.choices, read_only=True)
    plan = serializers.SerializerMethodField()
    engine = serializers.CharField(source="effective_engine", read_only=True)
    endpoint_url = serializers.CharField(
        read_only=True, help_text="Server root (no /v1); blank until it serves. Staff only."
    )
    command_line = serializers.CharField(read_only=True)

    class Meta:
        model = Deployment
        fields = [
            "id",
            "name",
            "team",
            "model_version",
            "profile",
            "node",
            "gpu_indices",
            "desired_state",
            "state",
            "state_reason",
            "endpoint_url",
            "concurrency_cap",
            "sla_p95_ttft_s",
            "sla_p95_tpot_s",
            "shared",
            "gpu_failure_policy",
            "plan",
            "adopted",
            "engine",
            "command_line",
            "port",
            "pid",
            "failure_code",
            "restart_count",
            "start_requested_at",
            "serving_since",
            "last_checked_at",
            "created_at",
            "updated_at",
        ]
        read_only_fields = [
            "sla_p95_ttft_s",  # set through POST .../sla/
            "sla_p95_tpot_s",
            "state_reason",
            "endpoint_url",
            "adopted",
            "port",
            "pid",
            "failure_code",
            "restart_count",
            "start_requested_at",
            "serving_since",
            "last_checked_at",
            "created_at",
            "updated_at",
        ]

    def get_plan(self, deployment: Deployment) -> dict | None:
        try:
            return _plan_dict(services.deployment_plan(deployment))
        except ApplicationError:
            return None

    def to_representation(self, instance):
        data = super().to_representation(instance)
        user = getattr(self.context.get("request"), "user", None)
        if user is not None and "state_reason" in data:
            data["state_reason"] = deployment_text_for(user, instance, data["state_reason"])
        return data

    def create(self, validated_data):
        return services.deployment_create(**validated_data)


class EventSerializer(serializers.ModelSerializer):
    class Meta:
        model = DeploymentEvent
        fields = ["at", "step", "status", "message", "seconds"]


class SampleSerializer(serializers.ModelSerializer):
    class Meta:
        model = MetricsSample
        fields = [
            "at",
            "healthy",
            "running",
            "waiting",
            "kv_cache_usage",
            "preemptions",
            "prompt_tokens",
            "generation_tokens",
            "requests_finished",
            "memory_mb",
        ]


class RegisterEndpointSerializer(serializers.Serializer):
    name = serializers.SlugField(max_length=100)
    team = serializers.SlugRelatedField(slug_field="slug", queryset=Team.objects.all())
    model_version = serializers.SlugRelatedField(slug_field="name", queryset=ModelVersion.objects.all())
    url = serializers.CharField(help_text="http://host:port/v1 (or the server root).")
    node = serializers.SlugRelatedField(
        slug_field="name", queryset=Node.objects.all(), required=False, allow_null=True, default=None
    )
    shared = serializers.BooleanField(required=False, default=False)
    api_key = serializers.CharField(
        required=False,
        default="",
        allow_blank=True,
        max_length=200,
        write_only=True,
        trim_whitespace=True,
        help_text="The key the server was started with (sent to it as a bearer token; never shown).",
    )


class SlaSerializer(serializers.Serializer):
    p95_ttft_s = serializers.FloatField(
        min_value=0.001, max_value=services.SLA_TTFT_MAX_S, help_text="P95 time to first token, seconds."
    )
    p95_tpot_s = serializers.FloatField(
        min_value=0.0001, max_value=services.SLA_TPOT_MAX_S, help_text="P95 time per output token, seconds."
    )


class DeploymentViewSet(viewsets.ModelViewSet):
    """Deployments. Creating one checks the plan, free GPUs and the team's GPU quota.

    There is no update (PUT and PATCH answer 405): changing where or how a deployment
    runs means a new deployment. Its desired state changes through the `start`, `stop`
    and `restart` actions, and its gateway concurrency cap through a benchmark run's
    `apply-cap` (`POST /api/v1/benchmark-runs/<id>/apply-cap/`).
    """

    filterset_class = DeploymentFilter

    serializer_class = DeploymentSerializer
    lookup_field = "name"
    http_method_names = ["get", "post", "delete", "head", "options"]

    def get_queryset(self):
        if getattr(self, "swagger_fake_view", False):  # schema generation has no user
            return Deployment.objects.none()
        return deployments_visible_to(self.request.user)

    def perform_destroy(self, instance: Deployment) -> None:
        services.deployment_delete(deployment=instance)

    def _requested(self, request, service) -> Response:
        deployment = service(deployment=self.get_object(), user=request.user)
        return Response(self.get_serializer(deployment).data, status=status.HTTP_202_ACCEPTED)

    @extend_schema(request=None, responses={202: DeploymentSerializer})
    @action(detail=True, methods=["post"])
    def start(self, request, name=None):
        """Want it running; the node's agent starts it (watch `state` and the timeline)."""
        return self._requested(request, services.deployment_request_start)

    @extend_schema(request=None, responses={202: DeploymentSerializer})
    @action(detail=True, methods=["post"])
    def stop(self, request, name=None):
        """Want it stopped; the agent drains it, stops its process group and frees its port."""
        return self._requested(request, services.deployment_request_stop)

    @extend_schema(request=None, responses={202: DeploymentSerializer})
    @action(detail=True, methods=["post"])
    def restart(self, request, name=None):
        return self._requested(request, services.deployment_request_restart)

    @extend_schema(request=SlaSerializer, responses={200: DeploymentSerializer})
    @action(detail=True, methods=["post"])
    def sla(self, request, name=None):
        """Set the SLA production latency is judged by (SLA breaches) and new benchmark runs use."""
        data = SlaSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        deployment = services.deployment_set_sla(
            deployment=self.get_object(), user=request.user, **data.validated_data
        )
        return Response(self.get_serializer(deployment).data)

    @extend_schema(responses={200: EventSerializer(many=True)})
    @action(detail=True, methods=["get"], pagination_class=None)
    def timeline(self, request, name=None):
        """Every step of the deployment's life, oldest first."""
        deployment = self.get_object()
        events = list(deployment.events.all())
        for e in events:  # shown, never saved
            e.message = deployment_text_for(request.user, deployment, e.message, step=e.step)
        return Response(EventSerializer(events, many=True).data)

    @extend_schema(responses={200: SampleSerializer(many=True)})
    @action(detail=True, methods=["get"], pagination_class=None)
    def samples(self, request, name=None):
        """The last supervision samples (health, vLLM gauges and counters, memory), oldest first."""
        try:
            limit = max(1, min(int(request.query_params.get("limit", 120)), 2000))
        except ValueError as error:
            raise ApplicationError("limit must be a whole number", field="limit") from error
        samples = list(self.get_object().samples.order_by("-at")[:limit])[::-1]
        return Response(SampleSerializer(samples, many=True).data)

    @extend_schema(request=RegisterEndpointSerializer, responses={201: DeploymentSerializer})
    @action(detail=False, methods=["post"], url_path="register-endpoint")
    def register_endpoint(self, request):
        """Adopt a vLLM server the portal did not start: health-checked and routed to, never stopped."""
        data = RegisterEndpointSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        deployment = services.endpoint_register(**data.validated_data)
        return Response(self.get_serializer(deployment).data, status=status.HTTP_201_CREATED)


class _PlanTargetSerializer(serializers.Serializer):
    gpu = serializers.CharField(help_text="GPU catalog key, e.g. v100-sxm2-32gb.")
    gpus = serializers.IntegerField(min_value=1, max_value=64)
    model = serializers.CharField(help_text="A registered model name or a bundled config name.")
    nvlink = serializers.BooleanField(required=False, allow_null=True, default=None)


_KNOB_FIELDS = {
    "str": serializers.CharField,
    "int": serializers.IntegerField,
    "float": serializers.FloatField,
}


def _knob_serializer_fields() -> dict[str, serializers.Field]:
    """One optional field per launch knob (inference/profile.py): the planner request takes every
    knob a profile has, by the same name; ProfileSettings bounds the values (a 400 naming the field)."""
    found: dict[str, serializers.Field] = {}
    for spec, knob in launch_knobs():
        kind, nullable = knob_type(spec)
        field_class = serializers.BooleanField if kind == "bool" else _KNOB_FIELDS[kind]
        extra = {"allow_null": True} if nullable else {}
        found[spec.name] = field_class(required=False, help_text=f"vLLM's {knob.flag}", **extra)
    return found


# The target, then every launch knob: a knob added to ProfileSettings is taken here by itself.
PlanRequestSerializer = type("PlanRequestSerializer", (_PlanTargetSerializer,), _knob_serializer_fields())


class PlanApi(APIView):
    """The capacity planner: weights per GPU, KV capacity, decode ceiling and findings.

    A POST that changes nothing, so every signed-in user may call it.
    """

    permission_classes = [IsAuthenticated]

    @extend_schema(request=PlanRequestSerializer, responses={200: dict})
    def post(self, request):
        data = PlanRequestSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        return Response(services.plan_on_catalog_gpus(**data.validated_data).to_dict())


class TeamWithGpusSerializer(teams_apis.TeamSerializer):
    """A team as the API shows it: with the GPUs its deployments hold against `gpu_quota`."""

    gpus_held = serializers.SerializerMethodField()

    class Meta(teams_apis.TeamSerializer.Meta):
        fields = [*teams_apis.TeamSerializer.Meta.fields[:-1], "gpus_held", "created_at"]

    def get_gpus_held(self, team: Team) -> int:
        return gpus_held_by_team(team)


class TeamViewSet(teams_apis.TeamViewSet):
    """`/api/v1/teams/`: the teams app's viewset, with GPUs held (which only deployments know)."""

    serializer_class = TeamWithGpusSerializer
