from django.contrib import admin
from django.utils.html import format_html

from .models import AuditEvent


@admin.register(AuditEvent)
class AuditEventAdmin(admin.ModelAdmin):
    """Read-only: the log is append-only (no add, change or delete, not even for superusers).

    Columns carry readable headers (the field names `actor_repr`, `target_repr` and `ip` would read
    ACTOR REPR, TARGET REPR, IP), and the address never wraps, so an IPv6 address stays whole.
    """

    list_display = ["at", "who", "action", "target_type", "target", "address"]
    list_filter = ["action", "target_type"]
    search_fields = ["actor_repr", "action", "target_repr", "target_id"]
    date_hierarchy = "at"
    fields = ["at", "actor", "who", "action", "target_type", "target_id", "target", "changes", "address"]
    readonly_fields = [
        "at",
        "actor",
        "who",
        "action",
        "target_type",
        "target_id",
        "target",
        "changes",
        "address",
    ]

    @admin.display(description="who", ordering="actor_repr")
    def who(self, event: AuditEvent) -> str:
        return event.actor_repr

    @admin.display(description="target", ordering="target_repr")
    def target(self, event: AuditEvent) -> str:
        return event.target_repr

    @admin.display(description="client address", ordering="ip")
    def address(self, event: AuditEvent) -> str:
        if not event.ip:
            return "—"
        return format_html('<span class="audit-address" style="white-space: nowrap">{}</span>', event.ip)

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False
