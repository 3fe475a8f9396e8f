from django.urls import path

from . import schema, views

app_name = "gateway"
urlpatterns = [
    path("models", views.models, name="models"),
    path("chat/completions", views.chat_completions, name="chat-completions"),
    path("completions", views.completions, name="completions"),
    path("openapi.json", schema.openapi, name="openapi"),
]
