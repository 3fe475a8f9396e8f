"""REST API for teams. Members see their own teams; staff see all.

The routed viewset adds the GPUs a team's deployments hold (portal/deployments/apis.py).
"""

from __future__ import annotations

from django.contrib.auth import get_user_model
from rest_framework import serializers, viewsets

from portal.audit.api import AuditedModelViewSetMixin

from .models import Team


class TeamSerializer(serializers.ModelSerializer):
    members = serializers.SlugRelatedField(
        slug_field="username", many=True, queryset=get_user_model().objects.all(), required=False
    )

    class Meta:
        model = Team
        fields = ["id", "name", "slug", "members", "gpu_quota", "created_at"]


class TeamViewSet(AuditedModelViewSetMixin, viewsets.ModelViewSet):
    serializer_class = TeamSerializer
    lookup_field = "slug"

    def get_queryset(self):
        if getattr(self, "swagger_fake_view", False):  # schema generation has no user
            return Team.objects.none()
        teams = Team.objects.prefetch_related("members")
        user = self.request.user
        return teams if user.is_staff else teams.filter(members=user)
