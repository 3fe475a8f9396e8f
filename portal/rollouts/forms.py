"""The start-a-rollout form (staff)."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

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
    compare_sla_only = forms.BooleanField(
        required=False,
        label="Compare against the SLA only",
        help_text="Leave the old version out of the judgement: for a new deployment on other GPUs, "
        "another GPU count or tensor-parallel size, whose latencies differ whatever the version.",
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


MAX_SHARE_LINES = 50
SHARE_ITEM = re.compile(r"^\s*([^=\s]{1,100})\s*=\s*([0-9]{1,3}(?:\.[0-9]{1,2})?)\s*%?\s*$")


class SharesField(forms.CharField):
    """ "chat-v1=70, chat-v2=30": percent per version (two decimals at most) → basis points; the
    sum and the versions' existence are the service's to check (registry.services)."""

    def __init__(self, **kwargs) -> None:
        kwargs.setdefault("max_length", 2000)
        kwargs.setdefault(
            "help_text", "version=percent, comma separated, adding up to 100 (e.g. chat-v1=90, chat-v2=10)."
        )
        super().__init__(**kwargs)

    def to_python(self, value) -> dict[str, int]:  # type: ignore[override]  # the text, parsed
        text = super().to_python(value) or ""
        parts = [part for part in text.split(",") if part.strip()]
        if not parts:
            raise forms.ValidationError("Name at least one version and its share.")
        if len(parts) > MAX_SHARE_LINES:
            raise forms.ValidationError(f"At most {MAX_SHARE_LINES} versions.")
        shares: dict[str, int] = {}
        for part in parts:
            found = SHARE_ITEM.match(part)
            if found is None:
                raise forms.ValidationError(f"“{part.strip()}” is not version=percent (e.g. chat-v1=90).")
            try:
                percent = Decimal(found[2])
            except InvalidOperation:
                raise forms.ValidationError(f"“{found[2]}” is not a percentage.") from None
            if percent > 100:
                raise forms.ValidationError(f"A share is 0 to 100 %, not {percent}.")
            if found[1] in shares:
                raise forms.ValidationError(f"`{found[1]}` is named twice.")
            shares[found[1]] = int(percent * 100)
        return shares


class ServedModelCreateForm(forms.Form):
    name = forms.CharField(max_length=100, help_text="The stable name clients call.")
    description = forms.CharField(max_length=200, required=False)
    shares = SharesField()


class SharesForm(forms.Form):
    shares = SharesField(
        help_text="version=percent, comma separated, adding up to 100; a version left out leaves."
    )
