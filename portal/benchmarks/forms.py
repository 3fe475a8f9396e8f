"""Forms: start a benchmark run, import an external table (accepting a node: acceptance/forms.py)."""

from __future__ import annotations

import re

from django import forms

from inference.loadgen.workloads import MAX_INLINE_CHARS, PRESETS
from portal.core.forms import choice_field

from .services import FIELD_GUIDE_7B_TABLE, MAX_SEED


def _numbers(text: str, kind, field: str) -> list:
    # Commas, spaces or both: "8 32 128" is three levels, not 832128 (issue 38).
    try:
        values = [kind(part) for part in re.split(r"[,\s]+", text.strip()) if part]
    except ValueError as error:
        raise forms.ValidationError(f"write {field} as a comma-separated list, e.g. 16,32") from error
    if any(v <= 0 for v in values):
        raise forms.ValidationError(f"{field} must be > 0")
    return values


class RunForm(forms.Form):
    deployment = forms.ChoiceField(required=False, help_text="A serving deployment (or an endpoint below).")
    endpoint_url = forms.URLField(
        required=False, assume_scheme="http", label="Endpoint URL (staff)", help_text="Server root, no /v1."
    )
    model_name = forms.CharField(required=False, label="Model name (with an endpoint URL)")
    mix = forms.CharField(
        initial="field-mix",
        max_length=MAX_INLINE_CHARS,
        help_text="A preset ("
        + ", ".join(PRESETS)
        + '), fixed:<in>:<out>, or an inline JSON mix {"buckets": [{"share": 1, "prompt": [100, 300], '
        '"output": [200, 500]}]}.',
    )
    concurrencies = forms.CharField(
        initial="16,32", required=False, help_text="Closed-loop levels, e.g. 16,32,64."
    )
    request_rates = forms.CharField(
        required=False, help_text="Open-loop Poisson levels in requests/s, e.g. 2,4."
    )
    requests_per_level = forms.IntegerField(min_value=1, required=False, initial=64)
    duration_s = forms.FloatField(min_value=0.1, required=False, label="Or seconds per level")
    seed = forms.IntegerField(initial=0, min_value=0, max_value=MAX_SEED)
    level_timeout_s = forms.FloatField(min_value=1, required=False, label="Level timeout (s)")
    title = forms.CharField(required=False, max_length=200)

    def __init__(self, *args, deployments=(), **kwargs) -> None:
        super().__init__(*args, **kwargs)
        choice_field(self, "deployment").choices = [("", "—")] + [
            (d.name, f"{d.name} ({d.state})") for d in deployments
        ]

    def clean_concurrencies(self) -> list[int]:
        return _numbers(self.cleaned_data.get("concurrencies") or "", int, "concurrencies")

    def clean_request_rates(self) -> list[float]:
        return _numbers(self.cleaned_data.get("request_rates") or "", float, "request rates")

    def clean(self):
        super().clean()
        data = self.cleaned_data
        if data.get("requests_per_level") and data.get("duration_s"):
            self.add_error("duration_s", "give either requests per level or a duration, not both")
        return data


class ImportForm(forms.Form):
    title = forms.CharField(max_length=200, initial="V100 field guide: 7B/TP8 on 8×V100-32G (one run)")
    deployment = forms.ChoiceField(required=False)
    table = forms.CharField(
        widget=forms.Textarea(attrs={"rows": 10, "cols": 90}),
        initial=FIELD_GUIDE_7B_TABLE,
        help_text="Markdown, CSV or tab-separated; columns named like concurrency, output tok/s, "
        "mean TTFT s, P95 TTFT s, mean TPOT s, P95 TPOT s (optional: mean E2EL s, mean output tokens).",
    )

    def __init__(self, *args, deployments=(), **kwargs) -> None:
        super().__init__(*args, **kwargs)
        choice_field(self, "deployment").choices = [("", "—")] + [(d.name, d.name) for d in deployments]
