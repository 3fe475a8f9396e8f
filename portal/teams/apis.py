"""REST API for teams. Members see their own teams; staff see all.

The routed viewset adds the GPUs a team's deployments hold (portal/deployments/apis.py).
"""

from __future__ import annotations

from django.contrib.auth import get_user_model
from drf_spectacular.utils import extend_schema
from rest_framework import serializers, viewsets
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response

from portal.audit.api import AuditedModelViewSetMixin

from .filters import TeamFilter
from .models import PriorityClass, Team
from .selectors import usage_by_priority_class


class TeamSerializer(serializers.ModelSerializer):
    members = serializers.SlugRelatedField(
        slug_field="username", many=True, queryset=get_user_model().objects.all(), required=False
    )

    class Meta:
        model = Team
        fields = ["id", "name", "slug", "members", "gpu_quota", "priority_class", "created_at"]


class UsageByClassSerializer(serializers.Serializer):
    priority_class = serializers.ChoiceField(choices=PriorityClass.choices)
    today_requests = serializers.IntegerField()
    today_tokens = serializers.IntegerField()
    days_requests = serializers.IntegerField(help_text="The last 30 UTC days, today included (rollups).")
    days_tokens = serializers.IntegerField()


class TeamViewSet(AuditedModelViewSetMixin, viewsets.ModelViewSet):
    filterset_class = TeamFilter
    serializer_class = TeamSerializer
    lookup_field = "slug"

    def get_queryset(self):
        if getattr(self, "swagger_fake_view", False):  # schema generation has no user
            return Team.objects.none()
        teams = Team.objects.prefetch_related("members")
        user = self.request.user
        assert user.is_authenticated  # the API's permission class: signed-in users only
        return teams if user.is_staff else teams.filter(members=user)

    @extend_schema(responses=UsageByClassSerializer(many=True))
    @action(detail=True, methods=["get"], pagination_class=None)  # one row per class: nothing to page
    def usage(self, request: Request, slug: str | None = None) -> Response:
        """The team's usage per priority class: today (usage records) and the last 30 days (rollups)."""
        return Response(UsageByClassSerializer(usage_by_priority_class(self.get_object()), many=True).data)
