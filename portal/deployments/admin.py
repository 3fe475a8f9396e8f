from django import forms
from django.contrib import admin, messages
from django.db import models
from django.http import HttpResponseRedirect
from django.urls import reverse
from django.utils.html import format_html, format_html_join

from portal.core.errors import ApplicationError
from portal.core.forms import EmptyJSONIsDefaultAdmin

from . import services
from .forms import GpuIndicesField
from .models import AdoptedEndpoint, Deployment, DeploymentEvent, DeploymentProfile


def _findings_html(compute_plan) -> str:
    """The planner's verdict and findings, or why there is no plan."""
    try:
        plan = compute_plan()
    except ApplicationError as error:
        return error.message
    if plan is None:
        return "—"
    items = format_html_join(
        "", "<li><b>{}</b> {} <code>{}</code></li>", ((f.level, f.message, f.code) for f in plan.findings)
    )
    verdict = "accepted" if plan.ok else "refused"
    return format_html("<p>Planner: {}</p><ul>{}</ul>", verdict, items)


@admin.register(DeploymentProfile)
class DeploymentProfileAdmin(EmptyJSONIsDefaultAdmin, admin.ModelAdmin):
    list_display = [
        "name",
        "model_version",
        "target_gpu",
        "target_gpu_count",
        "dtype",
        "tensor_parallel_size",
        "max_model_len",
        "gpu_memory_utilization",
        "max_num_seqs",
        "enforce_eager",
        "planner_verdict",
    ]
    list_filter = ["dtype", "tensor_parallel_size", "enforce_eager", "enable_prefix_caching", "target_gpu"]
    search_fields = ["name", "description", "model_version__name"]
    readonly_fields = ["findings"]

    @admin.display(description="Planner")
    def planner_verdict(self, profile: DeploymentProfile) -> str:
        try:
            plan = services.profile_plan(profile)
        except ApplicationError as error:
            return error.message
        if plan is None:
            return "no target"
        return "ok" if plan.ok else "refused"

    @admin.display(description="Planner findings")
    def findings(self, profile: DeploymentProfile) -> str:
        if not profile.pk:
            return "Save the profile to see the planner's findings."
        return _findings_html(lambda: services.profile_plan(profile))

    # After "Save", the profile's own page (its plan, its deployments), not the admin's list.
    def response_post_save_add(self, request, obj: DeploymentProfile) -> HttpResponseRedirect:
        return HttpResponseRedirect(reverse("deployments:profile-detail", args=[obj.name]))

    def response_post_save_change(self, request, obj: DeploymentProfile) -> HttpResponseRedirect:
        return HttpResponseRedirect(reverse("deployments:profile-detail", args=[obj.name]))


# The SLA production latency is judged by (portal/observability), editable on create and change.
SLA_FIELDS = ("sla_p95_ttft_s", "sla_p95_tpot_s")


def _field_default(name: str) -> object:
    field = Deployment._meta.get_field(name)
    assert isinstance(field, models.Field)  # a column, not a relation
    return field.default


class DeploymentForm(forms.ModelForm):
    # Typed as 0-3 or 0,2 (not JSON); the portal's own page is deployments:deployment-new.
    gpu_indices = GpuIndicesField()

    class Meta:
        model = Deployment
        fields = [*services.DEPLOYMENT_CREATE_FIELDS, *SLA_FIELDS]

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.instance.pk is None and "desired_state" in self.fields:
            self.fields["desired_state"].initial = "running"  # what creating one is for
        # Blank only for adopted servers, which have their own admin.
        for name in ("profile", "node"):
            if name in self.fields:
                self.fields[name].required = True

    def clean(self):
        super().clean()
        cleaned = self.cleaned_data
        if all(cleaned.get(f) is not None for f in SLA_FIELDS):
            try:
                services.sla_check(p95_ttft_s=cleaned["sla_p95_ttft_s"], p95_tpot_s=cleaned["sla_p95_tpot_s"])
            except ApplicationError as error:
                self.add_error(error.field, error.message)
        if self.instance.pk is None and not self.errors:
            # The same checks as the API; DeploymentAdmin.save_model then creates it through the service.
            try:
                unchecked = {"name", "concurrency_cap", "shared", "gpu_failure_policy"}
                checked = set(services.DEPLOYMENT_CREATE_FIELDS) - unchecked
                services.deployment_check(**{k: cleaned[k] for k in checked})
            except ApplicationError as error:
                raise forms.ValidationError(error.message) from error
        return cleaned


class DeploymentEventInline(admin.TabularInline):
    model = DeploymentEvent
    fields = ["at", "step", "status", "seconds", "message"]
    readonly_fields = ["at", "step", "status", "seconds", "message"]
    extra = 0
    can_delete = False
    ordering = ["-at", "-id"]

    def has_add_permission(self, request, obj=None) -> bool:
        return False


@admin.register(Deployment)
class DeploymentAdmin(admin.ModelAdmin):
    form = DeploymentForm
    list_display = [
        "name",
        "team",
        "model_version",
        "profile",
        "node",
        "gpu_indices",
        "desired_state",
        "state",
        "shared",
    ]
    list_filter = ["state", "desired_state", "adopted", "shared", "team", "node"]
    search_fields = ["name", "model_version__name", "profile__name", "node__name", "team__name"]
    readonly_fields = [
        "state",
        "state_reason",
        "failure_code",
        "endpoint_url",
        "command_line",
        "pid",
        "port",
        "restart_count",
        "serving_since",
        "findings",
    ]
    inlines = [DeploymentEventInline]
    actions = ["start_selected", "stop_selected", "restart_selected"]

    def get_queryset(self, request):
        return super().get_queryset(request).filter(adopted=False)

    def get_inlines(self, request, obj):
        return self.inlines if obj is not None else []  # a new deployment has no timeline yet

    def _request(self, request, queryset, service, verb: str) -> None:
        done = 0
        for deployment in queryset:
            try:
                service(deployment=deployment, user=request.user)
                done += 1
            except ApplicationError as error:
                self.message_user(request, f"{deployment.name}: {error.message}", messages.ERROR)
        if done:
            self.message_user(request, f"{verb} requested for {done} deployment(s)")

    @admin.action(description="Start the selected deployments")
    def start_selected(self, request, queryset) -> None:
        self._request(request, queryset, services.deployment_request_start, "start")

    @admin.action(description="Stop the selected deployments (drain first)")
    def stop_selected(self, request, queryset) -> None:
        self._request(request, queryset, services.deployment_request_stop, "stop")

    @admin.action(description="Restart the selected deployments")
    def restart_selected(self, request, queryset) -> None:
        self._request(request, queryset, services.deployment_request_restart, "restart")

    def delete_model(self, request, obj) -> None:
        services.deployment_delete(deployment=obj)

    def get_readonly_fields(self, request, obj=None):
        # Where a deployment runs is fixed once created: a new placement is a new deployment.
        return [*self.readonly_fields, *(services.DEPLOYMENT_PLACEMENT_FIELDS if obj else [])]

    def save_model(self, request, obj, form, change) -> None:
        if change:
            super().save_model(request, obj, form, change)
            return
        created = services.deployment_create(
            **{k: form.cleaned_data[k] for k in services.DEPLOYMENT_CREATE_FIELDS}
        )
        if any(form.cleaned_data[f] != _field_default(f) for f in SLA_FIELDS):
            services.deployment_set_sla(
                deployment=created,
                p95_ttft_s=form.cleaned_data["sla_p95_ttft_s"],
                p95_tpot_s=form.cleaned_data["sla_p95_tpot_s"],
                user=request.user,
            )
        obj.pk, obj._state.adding = created.pk, False

    @admin.display(description="Planner findings on its GPUs")
    def findings(self, deployment: Deployment) -> str:
        if not deployment.pk:
            return "—"
        return _findings_html(lambda: services.deployment_plan(deployment))


class AdoptedEndpointForm(forms.ModelForm):
    url = forms.CharField(help_text="http://host:port/v1 of the running vLLM server.")
    # Write-only: the stored key is never rendered back (PasswordInput drops it).
    api_key = forms.CharField(
        required=False,
        max_length=200,
        widget=forms.PasswordInput(render_value=False),
        help_text="The key the server was started with (--api-key / VLLM_API_KEY). "
        "Blank: none when adding, unchanged when editing.",
    )

    class Meta:
        model = AdoptedEndpoint
        fields = ["name", "team", "model_version", "node", "shared"]

    def clean(self):
        super().clean()
        cleaned = self.cleaned_data
        if all(cleaned.get(f) is not None for f in SLA_FIELDS):
            try:
                services.sla_check(p95_ttft_s=cleaned["sla_p95_ttft_s"], p95_tpot_s=cleaned["sla_p95_tpot_s"])
            except ApplicationError as error:
                self.add_error(error.field, error.message)
        if self.instance.pk is None and not self.errors:
            try:
                cleaned["endpoint_url"] = services.endpoint_url_from(cleaned.get("url", ""))
            except ApplicationError as error:
                raise forms.ValidationError({"url": error.message}) from error
        try:
            cleaned["api_key"] = services.engine_api_key_clean(cleaned.get("api_key", ""))
        except ApplicationError as error:
            raise forms.ValidationError({"api_key": error.message}) from error
        return cleaned


@admin.register(AdoptedEndpoint)
class AdoptedEndpointAdmin(admin.ModelAdmin):
    """Servers the portal did not start (register_endpoint): health-checked, never started or stopped."""

    form = AdoptedEndpointForm
    list_display = ["name", "team", "model_version", "endpoint_url", "shared", "state", "last_checked_at"]
    readonly_fields = ["endpoint_url", "state", "state_reason", "last_checked_at"]

    def get_queryset(self, request):
        return super().get_queryset(request).filter(adopted=True)

    def get_fields(self, request, obj=None):
        if obj is None:
            return ["name", "team", "model_version", "node", "shared", "url", "api_key"]
        return ["name", "team", "model_version", "node", "shared", "api_key", *self.readonly_fields]

    def save_model(self, request, obj, form, change) -> None:
        if change:
            if form.cleaned_data.get("api_key"):
                obj.engine_api_key = form.cleaned_data["api_key"]
            super().save_model(request, obj, form, change)
            return
        data = form.cleaned_data
        created = services.endpoint_register(
            name=data["name"],
            team=data["team"],
            model_version=data["model_version"],
            url=data["url"],
            node=data.get("node"),
            shared=data.get("shared", False),
            api_key=data.get("api_key", ""),
        )
        obj.pk, obj._state.adding = created.pk, False
