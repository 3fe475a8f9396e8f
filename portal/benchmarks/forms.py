"""Forms: start a benchmark run, import an external table, accept a node."""

from __future__ import annotations

from django import forms

from inference.hardware import GPU_CATALOG
from inference.loadgen.workloads import MAX_INLINE_CHARS, PRESETS
from inference.tiny_model import shape_names

from .acceptance import (
    DEFAULT_CONCURRENCY,
    DEFAULT_MIX,
    DEFAULT_SHAPE,
    MAX_REQUESTS_PER_LEVEL,
    default_shape_for,
)
from .services import FIELD_GUIDE_7B_TABLE, MAX_SEED


def _numbers(text: str, kind, field: str) -> list:
    try:
        values = [kind(part) for part in text.replace(" ", "").split(",") if part]
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
        self.fields["deployment"].choices = [("", "—")] + [
            (d.name, f"{d.name} ({d.state})") for d in deployments
        ]

    def clean_concurrencies(self) -> list[int]:
        return _numbers(self.cleaned_data.get("concurrencies") or "", int, "concurrencies")

    def clean_request_rates(self) -> list[float]:
        return _numbers(self.cleaned_data.get("request_rates") or "", float, "request rates")

    def clean(self):
        data = super().clean()
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
        self.fields["deployment"].choices = [("", "—")] + [(d.name, d.name) for d in deployments]


class AcceptanceForm(forms.Form):
    """The node page's "accept this node" form; bounds here, the rest checked by the service.

    Given the node, it fits it: a CPU-only node defaults to the tiny shape (a 7B shape is 27 GB of
    float32 weights in its RAM) and is not offered a prediction for "the node's GPU" it lacks.
    """

    shape = forms.ChoiceField(
        choices=[(name, name) for name in shape_names()],
        initial=DEFAULT_SHAPE,
        help_text="The reference model written with random weights: tiny, or a bundled model's shape.",
    )
    layers = forms.IntegerField(min_value=1, max_value=512, required=False, help_text="blank: the shape's")
    concurrency = forms.CharField(
        max_length=100,
        initial=",".join(map(str, DEFAULT_CONCURRENCY)),
        help_text="2 to 4 levels of concurrent users, e.g. 1,16,64",
    )
    mix = forms.CharField(
        max_length=200, initial=DEFAULT_MIX, help_text="A workload preset, or fixed:<in>:<out> tokens"
    )
    requests_per_level = forms.IntegerField(
        min_value=1, max_value=MAX_REQUESTS_PER_LEVEL, required=False, help_text="blank: 4 per user"
    )
    enforce_eager = forms.BooleanField(
        required=False,
        label="eager (no CUDA graphs)",
        help_text="What Volta deployments run with; a CPU node is always eager",
    )
    predict_gpu = forms.ChoiceField(
        choices=[("", "the node's GPU"), *((key, key) for key in sorted(GPU_CATALOG))],
        required=False,
        label="Predict for",
        help_text="The GPU the simulator predicts the same run for, to compare with the measurement",
    )

    def __init__(self, *args, node=None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if node is not None:
            self.fields["shape"].initial = default_shape_for(node)
        if node is not None and node.is_cpu_only:
            self.fields["shape"].help_text += " A CPU node computes in float32: keep to tiny."
            self.fields["predict_gpu"].choices = [
                ("", "none: no GPU here (measure only)"),
                *((key, f"{key} (what that GPU would do)") for key in sorted(GPU_CATALOG)),
            ]
            self.fields["predict_gpu"].initial = ""
            del self.fields["enforce_eager"]  # a CPU node always runs eager

    def clean(self) -> dict:
        data = super().clean()
        data.setdefault("enforce_eager", False)
        return data
