from django.contrib import admin

from .models import BenchmarkLevel, BenchmarkRun


class LevelInline(admin.TabularInline):
    model = BenchmarkLevel
    extra = 0
    fields = ("index", "concurrency", "request_rate", "created_at")
    readonly_fields = fields
    can_delete = False


@admin.register(BenchmarkRun)
class BenchmarkRunAdmin(admin.ModelAdmin):
    list_display = ("id", "kind", "title", "deployment", "mix", "state", "sla_concurrency", "created_at")
    list_filter = ("kind", "state", "mix")
    search_fields = ("title", "deployment__name", "model_name")
    readonly_fields = (
        "progress",
        "lease_token",
        "lease_owner",
        "lease_expires_at",
        "snapshot",
        "config",
        "mix_definition",
    )
    inlines = [LevelInline]
