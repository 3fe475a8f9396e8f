"""REST API for rollouts: staff start, pause, resume, promote and roll back; members read the
rollouts of the served names their team may call (any other is a 404)."""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import extend_schema
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.response import Response

from portal.core.errors import ApplicationError
from portal.deployments.models import Deployment
from portal.registry import apis as registry_apis
from portal.registry.models import ServedModel

from . import services
from .filters import RolloutFilter
from .models import Rollout, RolloutEvent
from .placement import GpuChoice
from .selectors import rollout_deployments_shown, rollouts_visible_to, served_models_visible_to


class RolloutEventSerializer(serializers.ModelSerializer):
    class Meta:
        model = RolloutEvent
        fields = ["at", "kind", "message", "data", "actor_repr"]


class RolloutSerializer(serializers.ModelSerializer):
    served_model: serializers.SlugRelatedField[Any] = serializers.SlugRelatedField(
        slug_field="name", read_only=True
    )
    from_version: serializers.SlugRelatedField[Any] = serializers.SlugRelatedField(
        slug_field="name", read_only=True
    )
    to_version: serializers.SlugRelatedField[Any] = serializers.SlugRelatedField(
        slug_field="name", read_only=True
    )
    from_deployment: serializers.SlugRelatedField[Any] = serializers.SlugRelatedField(
        slug_field="name", read_only=True
    )
    to_deployment: serializers.SlugRelatedField[Any] = serializers.SlugRelatedField(
        slug_field="name", read_only=True
    )
    freed_deployment: serializers.SlugRelatedField[Any] = serializers.SlugRelatedField(
        slug_field="name", read_only=True
    )
    shares_percent = serializers.SerializerMethodField(help_text="The served name's live shares, by version.")
    events = RolloutEventSerializer(many=True, read_only=True)
    warnings = serializers.SerializerMethodField(
        help_text="What the start warned about: a new deployment on other hardware than the old one's."
    )

    class Meta:
        model = Rollout
        fields = [
            "id",
            "served_model",
            "from_version",
            "to_version",
            "from_deployment",
            "to_deployment",
            "steps",
            "current_step",
            "state",
            "reason",
            "measurements",
            "freed_deployment",
            "downtime_s",
            "interval_s",
            "min_requests",
            "compare_sla_only",
            "warnings",
            "shares_percent",
            "created_at",
            "step_started_at",
            "finished_at",
            "events",
        ]
        read_only_fields = fields

    def to_representation(self, rollout: Rollout) -> dict:
        data = super().to_representation(rollout)
        request = self.context.get("request")
        if request is not None:  # another team's deployment is named to nobody else (selectors)
            shown = rollout_deployments_shown(request.user, rollout)
            for field in ("from_deployment", "to_deployment", "freed_deployment"):
                if getattr(rollout, f"{field}_id") not in shown:
                    data[field] = None
        return data

    def get_warnings(self, rollout: Rollout) -> list[str]:
        return [e.message for e in rollout.events.all() if e.kind == "warning"]  # prefetched

    def get_shares_percent(self, rollout: Rollout) -> dict[str, float]:
        rows = rollout.served_model.versions.values_list("model_version__name", "share_bp")
        return {name: share / 100 for name, share in rows}


class RolloutStartSerializer(serializers.Serializer):
    served_model = serializers.SlugRelatedField(slug_field="name", queryset=ServedModel.objects.all())
    to_deployment = serializers.SlugRelatedField(slug_field="name", queryset=Deployment.objects.all())
    from_deployment = serializers.SlugRelatedField(
        slug_field="name", queryset=Deployment.objects.all(), required=False, allow_null=True
    )
    steps = serializers.JSONField(
        required=False,
        help_text="[[5, 10], [25, 10], [50, 10], [100, 10]]: (share %, minutes) each; "
        '{"share_percent": 5, "seconds": 30} for a step in seconds.',
    )
    interval_s = serializers.IntegerField(
        required=False, help_text="Seconds between two measurements of a step (default ROLLOUT_TICK_S)."
    )
    min_requests = serializers.IntegerField(
        required=False, help_text="Requests a step needs before it may pass (default ROLLOUT_MIN_REQUESTS)."
    )
    compare_sla_only = serializers.BooleanField(
        required=False,
        help_text="Judge the new version on the SLA and the error ceiling only, not against the old one "
        "(for other hardware: the start warns when GPU kind, count or tensor-parallel size differ).",
    )
    gpu_choice = serializers.ChoiceField(
        choices=[c.value for c in GpuChoice],
        required=False,
        help_text="Where the old version holds the new deployment's GPUs: take one of its replicas out "
        "of the pool, or swap in place (the error without it lists what each would do, with the downtime).",
    )


class RollbackSerializer(serializers.Serializer):
    reason = serializers.CharField(required=False, allow_blank=True, max_length=300)


class RolloutViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    """Rollouts of a served name from one model version to another (docs/operators.md "Rollouts").
    Writes are staff only (the default permission); reads show a member the rollouts of the
    served names their team may call."""
    filterset_class = RolloutFilter

    serializer_class = RolloutSerializer

    def get_queryset(self):
        if getattr(self, "swagger_fake_view", False):
            return Rollout.objects.none()
        return rollouts_visible_to(self.request.user).prefetch_related("events")

    @extend_schema(request=RolloutStartSerializer, responses={201: RolloutSerializer})
    def create(self, request):
        data = RolloutStartSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        try:
            rollout = services.rollout_start(**data.validated_data, actor=request.user)
        except ApplicationError as error:
            if not error.extra.get("no_free_gpus"):
                raise
            # The ways to free the GPUs keep their types (the usual handler would stringify them).
            body = {error.field: [error.message], **error.extra}
            return Response(body, status=status.HTTP_400_BAD_REQUEST)
        return Response(RolloutSerializer(rollout).data, status=status.HTTP_201_CREATED)

    def _done(self, rollout: Rollout) -> Response:
        return Response(self.get_serializer(self.get_queryset().get(pk=rollout.pk)).data)

    @extend_schema(request=None, responses={200: RolloutSerializer})
    @action(detail=True, methods=["post"])
    def pause(self, request, pk=None):
        return self._done(services.rollout_pause(rollout=self.get_object(), actor=request.user))

    @extend_schema(request=None, responses={200: RolloutSerializer})
    @action(detail=True, methods=["post"])
    def resume(self, request, pk=None):
        return self._done(services.rollout_resume(rollout=self.get_object(), actor=request.user))

    @extend_schema(request=None, responses={200: RolloutSerializer})
    @action(detail=True, methods=["post"])
    def promote(self, request, pk=None):
        return self._done(services.rollout_promote(rollout=self.get_object(), actor=request.user))

    @extend_schema(request=RollbackSerializer, responses={200: RolloutSerializer})
    @action(detail=True, methods=["post"])
    def rollback(self, request, pk=None):
        data = RollbackSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        rollout = services.rollout_rollback(
            rollout=self.get_object(), actor=request.user, reason=data.validated_data.get("reason", "")
        )
        return self._done(rollout)


class ServedModelViewSet(registry_apis.ServedModelViewSet):
    """`/api/v1/served-models/`: the registry's viewset, showing a member only the names over a
    deployment of their team (which only deployments know: `served_models_visible_to`)."""

    def get_queryset(self):
        if getattr(self, "swagger_fake_view", False):
            return ServedModel.objects.none()
        return served_models_visible_to(self.request.user)
