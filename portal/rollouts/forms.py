"""The start-a-rollout form (staff)."""

from __future__ import annotations

import re

from django import forms

from portal.deployments.models import Deployment
from portal.deployments.selectors import acceptance_deployment_q
from portal.registry.models import ServedModel

from .placement import GpuChoice

STEP_TEXT = re.compile(r"^\s*(\d{1,3})\s*%?\s*[x×]\s*(\d{1,5})\s*(min|s)?\s*$")


class RolloutStartForm(forms.Form):
    served_model = forms.ModelChoiceField(queryset=ServedModel.objects.all(), to_field_name="name")
    to_deployment = forms.ModelChoiceField(
        queryset=Deployment.objects.exclude(acceptance_deployment_q()).select_related("model_version"),
        to_field_name="name",
        label="New deployment",
    )
    from_deployment = forms.ModelChoiceField(
        queryset=Deployment.objects.exclude(acceptance_deployment_q()).select_related("model_version"),
        to_field_name="name",
        required=False,
        label="Old deployment (stopped on promotion)",
    )
    steps = forms.CharField(
        initial="5x10, 25x10, 50x10, 100x10",
        max_length=400,
        help_text="share % × minutes (or 30s for seconds), comma separated; the last one 100 %.",
    )
    interval_s = forms.IntegerField(
        required=False, min_value=1, label="Measure every (s)", help_text="Blank: ROLLOUT_TICK_S."
    )
    min_requests = forms.IntegerField(
        required=False,
        min_value=1,
        help_text="Requests a step needs before it may pass (blank: ROLLOUT_MIN_REQUESTS).",
    )

    gpu_choice = forms.ChoiceField(
        choices=[
            ("", "only free GPUs"),
            (GpuChoice.TAKE_REPLICA.value, "take one replica of the old version out of the pool"),
            (GpuChoice.IN_PLACE.value, "swap in place (downtime)"),
        ],
        required=False,
        label="Where the new deployment's GPUs are held by the old version",
        help_text="Offered with what each means (and the downtime) when no GPUs are free.",
    )

    def clean_steps(self) -> list:
        steps: list = []
        for part in self.cleaned_data["steps"].split(","):
            found = STEP_TEXT.match(part)
            if found is None:
                raise forms.ValidationError(f"“{part.strip()}” is not share × minutes (e.g. 25x10).")
            if found[3] == "s":
                steps.append({"share_percent": int(found[1]), "seconds": int(found[2])})
            else:
                steps.append([int(found[1]), int(found[2])])
        return steps  # bounds are the service's (inference.rollout.parse_steps)
