from django.urls import path

from . import views

app_name = "rollouts"
urlpatterns = [
    path("", views.rollout_list, name="rollout-list"),
    path("new/", views.rollout_new, name="rollout-new"),
    path("served-models/", views.served_model_list, name="served-model-list"),
    path("served-models/new/", views.served_model_new, name="served-model-new"),
    path("served-models/<str:name>/", views.served_model_detail, name="served-model-detail"),
    path("served-models/<str:name>/shares/", views.served_model_shares, name="served-model-shares"),
    path("<int:pk>/", views.rollout_detail, name="rollout-detail"),
    path("<int:pk>/<str:action>/", views.rollout_action, name="rollout-action"),
]
