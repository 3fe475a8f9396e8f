"""The batch pages (the API is urls.py): a team's under /teams/<slug>/batches/, staff's at /batches/."""

from django.urls import path

from . import views

app_name = "batches"
urlpatterns = [
    path("teams/<slug:slug>/batches/", views.batch_list, name="list"),
    path("teams/<slug:slug>/batches/<str:batch_id>/", views.batch_detail, name="detail"),
    path("teams/<slug:slug>/batches/<str:batch_id>/cancel/", views.batch_cancel, name="cancel"),
    path("teams/<slug:slug>/batches/<str:batch_id>/<str:kind>.jsonl", views.batch_file, name="file"),
    path("batches/", views.staff_batches, name="staff"),
]
