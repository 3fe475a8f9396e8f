"""Form pieces every app's forms share."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django import forms
from django.db import models


def choice_field(form: forms.BaseForm, name: str) -> forms.ChoiceField:
    """`form.fields[name]`, a choice field, to set its choices (a form's fields are typed as Field)."""
    field = form.fields[name]
    assert isinstance(field, forms.ChoiceField)
    return field


def model_choice_field(form: forms.BaseForm, name: str) -> forms.ModelChoiceField[Any]:
    """`form.fields[name]`, a model choice field, to set its queryset."""
    field = form.fields[name]
    assert isinstance(field, forms.ModelChoiceField)
    return field


class JSONEmptyIsDefaultField(forms.JSONField):
    """A JSON box a person may empty: empty means the model field's default ([] or {}), which the
    column stores, instead of None, which its NOT NULL refuses with a 500 (issue 38: an emptied
    "Extra args" box)."""

    def __init__(self, *, empty: Callable[[], Any], **kwargs: Any) -> None:
        self.empty = empty
        super().__init__(**kwargs)

    def to_python(self, value: Any) -> Any:
        if value in self.empty_values or (isinstance(value, str) and not value.strip()):
            return self.empty()
        return super().to_python(value)

    def bound_data(self, data: Any, initial: Any) -> Any:
        if data in self.empty_values or (isinstance(data, str) and not data.strip()):
            return self.empty()
        return super().bound_data(data, initial)


def json_empty_is_default(db_field: models.Field, kwargs: dict[str, Any]) -> dict[str, Any]:
    """`kwargs` for `db_field.formfield()`: a blank-able, NOT NULL JSON column gets the field above."""
    optional = isinstance(db_field, models.JSONField) and db_field.blank and not db_field.null
    if optional and db_field.has_default():
        return {"form_class": JSONEmptyIsDefaultField, "empty": db_field.get_default, **kwargs}
    return kwargs


class EmptyJSONIsDefaultAdmin:
    """ModelAdmin mixin: every JSON box its forms show that a person may empty saves the default."""

    def formfield_for_dbfield(self, db_field: models.Field, request: Any, **kwargs: Any) -> forms.Field:
        kwargs = json_empty_is_default(db_field, kwargs)
        return super().formfield_for_dbfield(db_field, request, **kwargs)  # type: ignore[misc]


class LabelledTabularInline:
    """TabularInline mixin: a tabular inline names its columns in the table head, not with a <label>
    per box, so a screen reader reads each box nameless (axe's `label` rule, issue 38). Each editable
    box gets its column's name as aria-label."""

    def formfield_for_dbfield(self, db_field: models.Field, request: Any, **kwargs: Any) -> forms.Field:
        field = super().formfield_for_dbfield(db_field, request, **kwargs)  # type: ignore[misc]
        if field is not None:
            field.widget.attrs.setdefault("aria-label", str(field.label or db_field.verbose_name))
        return field

    def get_formset(self, request: Any, obj: Any = None, **kwargs: Any) -> type:
        formset: Any = super().get_formset(request, obj, **kwargs)  # type: ignore[misc]

        class Labelled(formset):  # the formset adds the delete box itself, not through a db field
            def add_fields(self, form: forms.Form, index: int | None) -> None:
                super().add_fields(form, index)
                if "DELETE" in form.fields:
                    form.fields["DELETE"].widget.attrs.setdefault("aria-label", "Delete")

        return Labelled
