from django.urls import path, re_path

from . import not_found, schema, views

app_name = "gateway"
urlpatterns = [
    path("models", views.models, name="models"),
    path("chat/completions", views.chat_completions, name="chat-completions"),
    path("completions", views.completions, name="completions"),
    path("openapi.json", schema.openapi, name="openapi"),
    # Last: anything else under /v1/ is the gateway's JSON 404, never the site's HTML page.
    re_path(r"^(?P<rest>.*)$", not_found.unknown_path, name="unknown-path"),
]
