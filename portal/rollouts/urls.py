from django.urls import path

from . import views

app_name = "rollouts"
urlpatterns = [
    path("", views.rollout_list, name="rollout-list"),
    path("new/", views.rollout_new, name="rollout-new"),
    path("<int:pk>/", views.rollout_detail, name="rollout-detail"),
    path("<int:pk>/<str:action>/", views.rollout_action, name="rollout-action"),
]
