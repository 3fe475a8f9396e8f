from django.contrib import admin
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView
from rest_framework.routers import DefaultRouter

from portal.benchmarks.apis import BenchmarkRunViewSet
from portal.core.views import favicon
from portal.deployments.apis import DeploymentViewSet, PlanApi, ProfileViewSet, TeamViewSet
from portal.gateway.not_found import unknown_path
from portal.inventory.apis import GpuViewSet, NodeViewSet
from portal.registry.apis import ConversionJobViewSet, ModelVersionViewSet
from portal.rollouts.apis import RolloutViewSet, ServedModelViewSet

router = DefaultRouter()
router.register("nodes", NodeViewSet, basename="node")
router.register("gpus", GpuViewSet, basename="gpu")
router.register("model-versions", ModelVersionViewSet, basename="model-version")
router.register("conversion-jobs", ConversionJobViewSet, basename="conversion-job")
router.register("profiles", ProfileViewSet, basename="profile")
router.register("deployments", DeploymentViewSet, basename="deployment")
router.register("teams", TeamViewSet, basename="team")
router.register("benchmark-runs", BenchmarkRunViewSet, basename="benchmark-run")
router.register("served-models", ServedModelViewSet, basename="served-model")
router.register("rollouts", RolloutViewSet, basename="rollout")

urlpatterns = [
    path("favicon.ico", favicon, name="favicon"),
    path("admin/", admin.site.urls),
    # Files and batches first: the gateway's URLconf ends with its JSON 404 for any other /v1/ path.
    path("v1/", include("portal.batches.urls")),
    path("v1/", include("portal.gateway.urls")),
    path("v1", unknown_path, name="gateway-root"),  # the gateway's JSON 404, naming its endpoints
    # Before observability's deployments/<name>/, so deployments/new/ is the create page.
    path("", include("portal.deployments.urls")),
    path("", include("portal.observability.urls")),
    path("accounts/", include("django.contrib.auth.urls")),
    path("api/v1/plan/", PlanApi.as_view(), name="api-plan"),
    path("api/v1/", include(router.urls)),
    path("api/schema/", SpectacularAPIView.as_view(), name="api-schema"),
    path("nodes/", include("portal.inventory.urls")),
    path("nodes/", include("portal.benchmarks.node_urls")),
    path("models/", include("portal.registry.urls")),
    path("teams/", include("portal.teams.urls")),
    path("teams/", include("portal.playground.urls")),
    path("", include("portal.batches.page_urls")),
    path("benchmarks/", include("portal.benchmarks.urls")),
    path("rollouts/", include("portal.rollouts.urls")),
    path("", include("portal.dashboard.urls")),
]
