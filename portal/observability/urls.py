from django.urls import path

from . import views

app_name = "observability"
urlpatterns = [
    path("metrics", views.metrics, name="metrics"),
    path("deployments/<slug:name>/", views.deployment_detail, name="deployment-detail"),
]
