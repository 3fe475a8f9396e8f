import json

from django import forms
from django.contrib import admin
from django.utils.html import format_html

from portal.core.errors import ApplicationError
from portal.core.forms import EmptyJSONIsDefaultAdmin

from .models import ConversionJob, ModelVersion
from .services import DERIVED_FIELDS, arch_fields, parse_config


class ModelVersionForm(forms.ModelForm):
    """Architecture facts are derived from the pasted config.json, never typed in."""

    config_json = forms.CharField(
        widget=forms.Textarea(attrs={"rows": 14, "cols": 100}),
        label="config.json",
        help_text="The model's Hugging Face config.json.",
    )

    class Meta:
        model = ModelVersion
        fields = ["name", "source", "revision", "path", "smoke_expected_substring"]

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.instance.pk:
            self.fields["config_json"].initial = json.dumps(self.instance.config, indent=2)
            self.fields["config_json"].disabled = True

    def clean_config_json(self) -> dict:
        if self.instance.pk:
            return self.instance.config
        try:
            config = json.loads(self.cleaned_data["config_json"])
        except json.JSONDecodeError as error:
            raise forms.ValidationError(f"not valid JSON: {error}") from error
        except RecursionError:
            raise forms.ValidationError("not valid JSON: nested too deeply") from None
        try:
            arch = parse_config(config)
        except ApplicationError as error:
            raise forms.ValidationError(error.message) from error
        for name, value in arch_fields(arch).items():
            setattr(self.instance, name, value)
        self.instance.config = config
        return config


@admin.register(ModelVersion)
class ModelVersionAdmin(admin.ModelAdmin):
    form = ModelVersionForm
    list_display = ["name", "model_type", "params", "weight_dtype", "quantization", "hashed", "created_at"]
    list_filter = ["model_type", "weight_dtype", "quantization"]
    search_fields = ["name", "source", "path"]
    readonly_fields = list(DERIVED_FIELDS)

    @admin.display(description="Parameters", ordering="param_count")
    def params(self, version: ModelVersion) -> str:
        return version.params_display

    @admin.display(description="Hashed", boolean=True)
    def hashed(self, version: ModelVersion) -> bool:
        return bool(version.weights_sha256)


@admin.register(ConversionJob)
class ConversionJobAdmin(EmptyJSONIsDefaultAdmin, admin.ModelAdmin):
    """Read-only: jobs are started from the model page or the API, and written by their runner."""

    list_display = [
        "id",
        "source",
        "new_name",
        "node",
        "state_shown",
        "progress",
        "overflow_total",
        "created_at",
    ]
    list_filter = ["state", "clamp"]
    search_fields = ["source__name", "new_name", "output_path"]
    list_select_related = ["source", "node"]

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    @admin.display(description="State")
    def state_shown(self, job: ConversionJob) -> str:
        return "interrupted" if job.is_stale else job.state

    @admin.display(description="Progress")
    def progress(self, job: ConversionJob) -> str:
        return format_html(
            '<progress class="conversion" max="100" value="{}"></progress> {}&nbsp;%',
            f"{job.percent:.1f}",
            f"{job.percent:.0f}",
        )
