import datetime as dt

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.widgets import FilteredSelectMultiple
from django.utils import timezone

from portal.core.charts import bar_chart_svg
from portal.core.forms import EmptyJSONIsDefaultAdmin, choice_field
from portal.registry.models import ModelVersion, ServedModel

from .models import ApiKey, Team, Usage, UsageDaily, UsageHourly
from .selectors import usage_daily_all_teams
from .services import api_key_revoke


class TeamAdminForm(forms.ModelForm):
    """Allowed models picked from the registry (a multi-select), not typed as a JSON list."""

    allowed_models = forms.MultipleChoiceField(
        required=False,
        widget=FilteredSelectMultiple("models", is_stacked=False),
        help_text="The models the team's keys may call; none picked: every model it can reach.",
    )

    class Meta:
        model = Team
        fields = "__all__"  # noqa: DJ007  (TeamAdmin decides which fields the page shows)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        names = set(ModelVersion.objects.values_list("name", flat=True))
        names |= set(ServedModel.objects.values_list("name", flat=True))  # stable names too
        names |= set(self.instance.allowed_models or [])  # one since deleted stays visible, and removable
        choice_field(self, "allowed_models").choices = [(name, name) for name in sorted(names)]


@admin.register(Team)
class TeamAdmin(admin.ModelAdmin):
    form = TeamAdminForm
    list_display = [
        "name", "slug", "priority_class", "gpu_quota", "rpm_limit", "tpm_limit", "tokens_per_day",
        "max_concurrent", "disabled_until", "member_count", "created_at",
    ]  # fmt: skip
    search_fields = ["name", "slug"]
    prepopulated_fields = {"slug": ["name"]}
    filter_horizontal = ["members"]

    @admin.display(description="Members")
    def member_count(self, team: Team) -> int:
        return team.members.count()


@admin.register(ApiKey)
class ApiKeyAdmin(EmptyJSONIsDefaultAdmin, admin.ModelAdmin):
    """Keys are created by their team (page or `create_key`), so the secret is shown once, to them.
    The digest is never shown."""

    list_display = ["__str__", "team", "name", "priority_class", "allowed_models", "created_at", "expires_at",
                    "last_used_at", "revoked_at", "disabled_until"]  # fmt: skip
    list_filter = ["team", "priority_class", "revoked_at"]
    search_fields = ["prefix", "name", "team__slug"]
    exclude = ["digest"]
    readonly_fields = ["prefix", "team", "created_by", "created_at", "last_used_at", "revoked_at",
                       "playground_user", "benchmark_user", "pinned_deployment_id",
                       "priority_class_set_by_staff"]  # fmt: skip
    actions = ["revoke"]

    def save_model(self, request, obj: ApiKey, form, change) -> None:
        # A class chosen here is staff's: it holds even above the team's class.
        if "priority_class" in form.changed_data:
            obj.priority_class_set_by_staff = bool(obj.priority_class)
        super().save_model(request, obj, form, change)

    def has_add_permission(self, request) -> bool:
        return False

    @admin.action(description="Revoke the selected keys (at once)")
    def revoke(self, request, queryset):
        revoked = sum(api_key_revoke(api_key=key) for key in queryset)
        self.message_user(request, f"Revoked {revoked} key(s).", messages.SUCCESS)


class UsageDayFilter(admin.SimpleListFilter):
    """One UTC day of records at a time (today unless another is picked): the table holds 100+
    million rows a day at fleet scale, so the list never counts or sorts more than a day."""

    title = "day (UTC)"
    parameter_name = "day"
    DAYS = 14

    def lookups(self, request, model_admin):
        today = timezone.now().astimezone(dt.UTC).date()
        return [((today - dt.timedelta(days=n)).isoformat(), "today" if n == 0 else
                 (today - dt.timedelta(days=n)).isoformat()) for n in range(self.DAYS)]  # fmt: skip

    def choices(self, changelist):
        for lookup, title in self.lookup_choices:
            yield {
                "selected": self.chosen() == dt.date.fromisoformat(lookup),
                "query_string": changelist.get_query_string({self.parameter_name: lookup}),
                "display": title,
            }

    def chosen(self) -> dt.date:
        try:
            return dt.date.fromisoformat(self.value() or "")
        except ValueError:
            return timezone.now().astimezone(dt.UTC).date()

    def queryset(self, request, queryset):
        start = dt.datetime.combine(self.chosen(), dt.time.min, tzinfo=dt.UTC)
        return queryset.filter(created_at__gte=start, created_at__lt=start + dt.timedelta(days=1))


@admin.register(Usage)
class UsageAdmin(admin.ModelAdmin):
    list_display = ["created_at", "team", "api_key", "model", "priority_class", "deployment", "status",
                    "http_status", "prompt_tokens", "completion_tokens", "ttft_ms",
                    "duration_ms"]  # fmt: skip
    # No date hierarchy and no filter by model: both read the distinct values of the whole table.
    list_filter = [UsageDayFilter, "status", "priority_class", "team"]
    list_select_related = ["team", "api_key", "deployment"]
    show_full_result_count = False

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False


@admin.register(UsageDaily)
class UsageDailyAdmin(admin.ModelAdmin):
    list_display = ["day", "team", "api_key", "model", "priority_class", "requests", "completed", "rejected",
                    "unavailable", "failed", "prompt_tokens", "completion_tokens"]  # fmt: skip
    list_filter = ["team", "model", "priority_class"]
    date_hierarchy = "day"
    change_list_template = "admin/teams/usagedaily/change_list.html"

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    def changelist_view(self, request, extra_context=None):
        series = usage_daily_all_teams()
        chart = bar_chart_svg(
            [(d.strftime("%m-%d"), v) for d, v in series],
            title="Tokens per day, all teams (30 days)",
            label_every=5,
        )
        return super().changelist_view(request, {**(extra_context or {}), "usage_chart": chart})


@admin.register(UsageHourly)
class UsageHourlyAdmin(admin.ModelAdmin):
    list_display = ["hour", "team", "api_key", "model", "priority_class", "requests", "completed", "rejected",
                    "unavailable", "failed", "prompt_tokens", "completion_tokens"]  # fmt: skip
    list_filter = ["team", "priority_class"]
    date_hierarchy = "hour"

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False
