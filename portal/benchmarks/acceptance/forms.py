"""The node page's *Accept this node* form."""

from __future__ import annotations

from django import forms

from inference.hardware import GPU_CATALOG
from inference.tiny_model import shape_names
from portal.core.forms import choice_field
from portal.deployments.models import DeploymentProfile

from .options import (
    DEFAULT_CONCURRENCY,
    DEFAULT_MIX,
    DEFAULT_SHAPE,
    MAX_REQUESTS_PER_LEVEL,
    default_shape_for,
)
from .request import fitting_defaults


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
    max_model_len = forms.IntegerField(
        min_value=64,
        max_value=1_048_576,
        required=False,
        label="max model length",
        help_text="blank: 4096 (or the shape's positions); the planner checks it fits the GPU first",
    )
    enforce_eager = forms.BooleanField(
        required=False,
        label="eager (no CUDA graphs)",
        help_text="What Volta deployments run with; a CPU node is always eager",
    )
    profile = forms.ModelChoiceField(
        queryset=DeploymentProfile.objects.order_by("name"),
        to_field_name="name",
        required=False,
        empty_label="none: vLLM's defaults",
        help_text="Launch with this deployment profile's vLLM flags (its eager setting replaces the box "
        "above); chunked prefill or prefix caching on: probed first (marked unsupported on Volta)",
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
            # What fits this node (the planner's answer), so the default form is one that runs.
            for name, value in fitting_defaults(node).items():
                self.fields[name].initial = value
        if node is not None and node.is_cpu_only:
            self.fields["shape"].help_text += " A CPU node computes in float32: keep to tiny."
            choice_field(self, "predict_gpu").choices = [
                ("", "none: no GPU here (measure only)"),
                *((key, f"{key} (what that GPU would do)") for key in sorted(GPU_CATALOG)),
            ]
            self.fields["predict_gpu"].initial = ""
            del self.fields["enforce_eager"]  # a CPU node always runs eager

    def clean(self) -> dict:
        super().clean()
        data = self.cleaned_data
        data.setdefault("enforce_eager", False)
        return data
