from django.urls import path

from . import views

app_name = "rollouts"
urlpatterns = [
    path("<int:pk>/", views.rollout_detail, name="rollout-detail"),
    path("<int:pk>/<str:action>/", views.rollout_action, name="rollout-action"),
]
