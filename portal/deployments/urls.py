from django.urls import path

from . import predict, views

app_name = "deployments"
urlpatterns = [
    path("profiles/", views.profile_list, name="profile-list"),
    path("profiles/<slug:name>/", views.profile_detail, name="profile-detail"),
    path("deployments/", views.deployment_list, name="deployment-list"),
    # Before observability's deployments/<name>/ (portal/urls.py includes this module first).
    path("deployments/new/", views.deployment_new, name="deployment-new"),
    # A deployment's own page is observability:deployment-detail (it shows production latency).
    path(
        "deployments/<slug:name>/<str:action>/",
        views.deployment_action,
        name="deployment-action",
    ),
    path("planner/", views.planner, name="planner"),
    # Under /teams/ beside the team's own pages (portal/teams/urls.py), which it links to.
    path("teams/<slug:slug>/", views.team_detail, name="team-detail"),
    path("planner/predict/", predict.predict, name="predict"),
]
