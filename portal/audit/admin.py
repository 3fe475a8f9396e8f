from django.contrib import admin

from .models import AuditEvent


@admin.register(AuditEvent)
class AuditEventAdmin(admin.ModelAdmin):
    """Read-only: the log is append-only (no add, change or delete, not even for superusers)."""

    list_display = ["at", "actor_repr", "action", "target_type", "target_repr", "ip"]
    list_filter = ["action", "target_type"]
    search_fields = ["actor_repr", "action", "target_repr", "target_id"]
    date_hierarchy = "at"
    readonly_fields = ["at", "actor", "actor_repr", "action", "target_type", "target_id", "target_repr",
                       "changes", "ip"]  # fmt: skip

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False
