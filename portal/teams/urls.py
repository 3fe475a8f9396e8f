from django.urls import path

from . import views

app_name = "teams"
urlpatterns = [
    path("<slug:slug>/keys/", views.team_keys, name="keys"),
    path("<slug:slug>/keys/<str:prefix>/revoke/", views.team_key_revoke, name="key-revoke"),
    path("<slug:slug>/usage/", views.team_usage, name="usage"),
]
