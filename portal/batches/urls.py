"""`/v1/files` and `/v1/batches` (portal/urls.py puts them before the gateway's catch-all)."""

from django.urls import path

from . import apis

app_name = "batches_api"
urlpatterns = [
    path("files", apis.files, name="files"),
    path("files/<str:file_id>", apis.file_detail, name="file"),
    path("files/<str:file_id>/content", apis.file_content, name="file-content"),
    path("batches", apis.batches, name="batches"),
    path("batches/<str:batch_id>", apis.batch_detail, name="batch"),
    path("batches/<str:batch_id>/cancel", apis.batch_cancel, name="batch-cancel"),
]
