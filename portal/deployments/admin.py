from django import forms
from django.contrib import admin
from django.utils.html import format_html, format_html_join

from portal.core.errors import ApplicationError

from . import services
from .models import Deployment, DeploymentProfile


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
class DeploymentProfileAdmin(admin.ModelAdmin):
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


class DeploymentForm(forms.ModelForm):
    class Meta:
        model = Deployment
        fields = list(services.DEPLOYMENT_CREATE_FIELDS)

    def clean(self):
        cleaned = super().clean()
        if self.instance.pk is None and not self.errors:
            # The same checks as the API; DeploymentAdmin.save_model then creates it through the service.
            try:
                checked = set(services.DEPLOYMENT_CREATE_FIELDS) - {"name", "concurrency_cap"}
                services.deployment_check(**{k: cleaned[k] for k in checked})
            except ApplicationError as error:
                raise forms.ValidationError(error.message) from error
        return cleaned


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
    ]
    list_filter = ["state", "desired_state", "team", "node"]
    search_fields = ["name", "model_version__name", "profile__name", "node__name", "team__name"]
    readonly_fields = ["state", "state_reason", "endpoint_url", "findings"]

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
        obj.pk, obj._state.adding = created.pk, False

    @admin.display(description="Planner findings on its GPUs")
    def findings(self, deployment: Deployment) -> str:
        if not deployment.pk:
            return "—"
        return _findings_html(lambda: services.deployment_plan(deployment))
