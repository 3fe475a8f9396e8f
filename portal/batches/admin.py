from django.contrib import admin

from .models import Batch, BatchFile


@admin.register(BatchFile)
class BatchFileAdmin(admin.ModelAdmin):
    list_display = ["public_id", "team", "purpose", "filename", "bytes", "created_at", "expires_at"]
    list_filter = ["purpose"]
    search_fields = ["public_id", "filename"]
    readonly_fields = ["public_id", "storage_name"]


@admin.register(Batch)
class BatchAdmin(admin.ModelAdmin):
    list_display = ["public_id", "team", "status", "request_total", "request_completed", "request_failed",
                    "wait_reason", "created_at"]  # fmt: skip
    list_filter = ["status", "wait_reason"]
    search_fields = ["public_id"]
    # State moves through services only (claims): the admin shows a batch, never edits its state.
    readonly_fields = [f.name for f in Batch._meta.fields]
