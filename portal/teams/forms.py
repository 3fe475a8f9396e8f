"""The team page's form for creating an API key."""

from __future__ import annotations

import datetime as dt

from django import forms
from django.utils import timezone

from portal.core.errors import did_you_mean

from .models import BIGINT_MAX, INT_MAX, PriorityClass


class ApiKeyCreateForm(forms.Form):
    name = forms.CharField(max_length=100, required=False, help_text="What the key is for.")
    models = forms.CharField(
        required=False, help_text="Comma-separated model names (blank: every model the team may use)."
    )
    expires_in_days = forms.IntegerField(
        min_value=1, max_value=3650, required=False, help_text="Blank: never."
    )
    rpm_limit = forms.IntegerField(
        min_value=1, max_value=INT_MAX, required=False, label="Requests per minute"
    )
    tpm_limit = forms.IntegerField(min_value=1, max_value=INT_MAX, required=False, label="Tokens per minute")
    tokens_per_day = forms.IntegerField(
        min_value=1, max_value=BIGINT_MAX, required=False, label="Tokens per day"
    )
    max_concurrent = forms.IntegerField(
        min_value=1, max_value=INT_MAX, required=False, label="Concurrent requests"
    )
    priority_class = forms.ChoiceField(
        choices=[("", "the team's class"), *PriorityClass.choices],
        required=False,
        label="Priority class",
        help_text="batch: only the spare capacity of a deployment, after interactive requests, with a "
        "longer queue wait (for offline jobs).",
    )

    def __init__(
        self, *args, model_names: list[str], served_names: list[str] | None = None, **kwargs
    ) -> None:
        """`model_names`: the registered models the team may call (a key's models must be among them);
        `served_names`: those of them that are served names, offered first (what clients should call)."""
        super().__init__(*args, **kwargs)
        self.model_names = model_names
        served = [name for name in model_names if name in set(served_names or ())]
        versions = [name for name in model_names if name not in set(served)]
        if not model_names:
            shown = "none registered yet"
        elif served:
            shown = f"served names {', '.join(served)}" + (
                f"; model versions by their own name {', '.join(versions)}" if versions else ""
            )
        else:
            shown = ", ".join(model_names)
        self.fields[
            "models"
        ].help_text = f"Comma-separated model names, from: {shown} (blank: every model the team may use)."

    def clean_models(self) -> list[str]:
        """The names, each one the team can call: a typo would make a key that can call nothing."""
        names = sorted({m.strip() for m in (self.cleaned_data.get("models") or "").split(",") if m.strip()})
        unknown = [m for m in names if m not in self.model_names]
        if unknown:
            first = unknown[0]
            raise forms.ValidationError(
                f"`{first}` is not a model your team can call.{did_you_mean(first, self.model_names)}"
            )
        return names

    def service_kwargs(self) -> dict:
        data = self.cleaned_data
        days = data.get("expires_in_days")
        return {
            "name": data.get("name", ""),
            "allowed_models": data.get("models") or [],
            "expires_at": timezone.now() + dt.timedelta(days=days) if days else None,
            "rpm_limit": data.get("rpm_limit"),
            "tpm_limit": data.get("tpm_limit"),
            "tokens_per_day": data.get("tokens_per_day"),
            "max_concurrent": data.get("max_concurrent"),
            "priority_class": data.get("priority_class") or "",
        }
