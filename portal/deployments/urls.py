from django.urls import path

from . import predict, views

app_name = "deployments"
urlpatterns = [
    path("profiles/", views.profile_list, name="profile-list"),
    path("profiles/<slug:name>/", views.profile_detail, name="profile-detail"),
    path("deployments/", views.deployment_list, name="deployment-list"),
    path("deployments/<slug:name>/", views.deployment_detail, name="deployment-detail"),
    path(
        "deployments/<slug:name>/<str:action>/",
        views.deployment_action,
        name="deployment-action",
    ),
    path("planner/", views.planner, name="planner"),
    path("planner/predict/", predict.predict, name="predict"),
]
