"""Read-only admin lists of SLA breaches (written by the latency rollup task, never by hand)."""

from django.contrib import admin

from .models import SlaBreach


@admin.register(SlaBreach)
class SlaBreachAdmin(admin.ModelAdmin):
    list_display = ["deployment", "started_at", "ended_at", "reason"]
    list_filter = ["deployment"]
    date_hierarchy = "started_at"

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False
