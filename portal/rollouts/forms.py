"""The start-a-rollout form (staff)."""

from __future__ import annotations

import re

from django import forms

from portal.deployments.models import Deployment
from portal.registry.models import ServedModel

STEP_TEXT = re.compile(r"^\s*(\d{1,3})\s*%?\s*[x×]\s*(\d{1,4})\s*(?:min)?\s*$")


class RolloutStartForm(forms.Form):
    served_model = forms.ModelChoiceField(queryset=ServedModel.objects.all(), to_field_name="name")
    to_deployment = forms.ModelChoiceField(
        queryset=Deployment.objects.select_related("model_version"),
        to_field_name="name",
        label="New deployment",
    )
    from_deployment = forms.ModelChoiceField(
        queryset=Deployment.objects.select_related("model_version"),
        to_field_name="name",
        required=False,
        label="Old deployment (stopped on promotion)",
    )
    steps = forms.CharField(
        initial="5x10, 25x10, 50x10, 100x10",
        max_length=400,
        help_text="share % × minutes, comma separated; the last one 100 %.",
    )

    def clean_steps(self) -> list[list[int]]:
        steps = []
        for part in self.cleaned_data["steps"].split(","):
            found = STEP_TEXT.match(part)
            if found is None:
                raise forms.ValidationError(f"“{part.strip()}” is not share × minutes (e.g. 25x10).")
            steps.append([int(found[1]), int(found[2])])
        return steps  # bounds are the service's (inference.rollout.parse_steps)
