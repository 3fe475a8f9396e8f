from django.urls import path

from . import views

app_name = "registry"
urlpatterns = [
    path("", views.model_list, name="model-list"),
    path("<str:name>/", views.model_detail, name="model-detail"),
    path("<str:name>/hash/", views.model_hash, name="model-hash"),
    path("<str:name>/simulated-release/", views.model_mark_simulated, name="model-mark-simulated"),
    path("<str:name>/convert/", views.model_convert, name="model-convert"),
    path("<str:name>/conversions/<int:pk>/", views.conversion_detail, name="conversion-detail"),
]
