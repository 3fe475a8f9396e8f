"""DRF glue: ApplicationError and model ValidationError become 400s with the field named; deleting a
row that others still refer to is a 409 naming them."""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from django.core.exceptions import ValidationError as DjangoValidationError
from django.db.models import ProtectedError, RestrictedError
from drf_spectacular.extensions import OpenApiSerializerExtension
from rest_framework import exceptions, parsers, serializers
from rest_framework.views import exception_handler as drf_exception_handler

from inference.errors import InputError

from .errors import ApplicationError
from .jsonbody import TOO_DEEP


class JSONParser(parsers.JSONParser):
    """DRF's JSON parser, with nesting too deep to parse a 400 like any other malformed body
    (a RecursionError is not the ValueError DRF catches: it was a 500, before authentication)."""

    def parse(self, stream, media_type=None, parser_context=None):
        try:
            return super().parse(stream, media_type, parser_context)
        except RecursionError:
            raise exceptions.ParseError(TOO_DEEP) from None


class InUse(exceptions.APIException):
    status_code = 409
    default_code = "in_use"


def _in_use(exc: ProtectedError | RestrictedError) -> InUse:
    blocking: Iterable[Any] = (
        exc.protected_objects if isinstance(exc, ProtectedError) else exc.restricted_objects
    )
    names = sorted({f"{obj._meta.verbose_name} {obj}" for obj in blocking})
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    return InUse(f"Still in use by {shown}: delete or change those first.")


def exception_handler(exc, context):
    if isinstance(exc, ProtectedError | RestrictedError):  # was a 500 (found by fuzzing the API)
        exc = _in_use(exc)
    if isinstance(exc, InputError):
        exc = ApplicationError.from_input_error(exc)
    if isinstance(exc, ApplicationError):
        detail = {exc.field or "non_field_errors": [exc.message], **exc.extra}
        exc = exceptions.ValidationError(detail)
    elif isinstance(exc, DjangoValidationError):
        exc = exceptions.ValidationError(
            exc.message_dict if hasattr(exc, "error_dict") else {"non_field_errors": exc.messages}
        )
    return drf_exception_handler(exc, context)


# The mixins below go before a ModelSerializer in a serializer's bases; the checker reads them as one.
if TYPE_CHECKING:
    _Serializer = serializers.ModelSerializer[Any]
else:
    _Serializer = object


class ModelCleanMixin(_Serializer):
    """Run the model's own `full_clean()` from a ModelSerializer, so the API and the
    admin refuse the same values with the same messages."""

    clean_exclude: tuple[str, ...] = ()

    def validate(self, attrs):
        attrs = super().validate(attrs)
        model: Any = self.Meta.model
        instance = copy.copy(self.instance) if self.instance is not None else model()
        concrete = {f.name for f in model._meta.concrete_fields}
        for name, value in attrs.items():
            if name in concrete:
                setattr(instance, name, value)
        try:
            instance.full_clean(exclude=list(self.clean_exclude), validate_unique=False)
        except DjangoValidationError as error:
            raise exceptions.ValidationError(error.message_dict) from error
        return attrs


class StaffOnlyFieldsMixin(_Serializer):
    """Leave `staff_only_fields` out of what a serializer shows anyone but staff.

    Where servers listen (endpoint URLs, ports, node hostnames, command lines) is for
    operators: members reach models through the gateway only (docs/decisions.md).
    """

    staff_only_fields: tuple[str, ...] = ()

    def to_representation(self, instance):
        data = super().to_representation(instance)
        request = self.context.get("request")
        user = getattr(request, "user", None)
        if not (user is not None and user.is_staff):
            for name in self.staff_only_fields:
                data.pop(name, None)
        return data


class StaffOnlyFieldsSchema(OpenApiSerializerExtension):
    """In the OpenAPI schema, staff-only fields are optional: members' responses leave them out."""

    target_class = StaffOnlyFieldsMixin
    match_subclasses = True

    def map_serializer(self, auto_schema, direction):
        schema = auto_schema._map_serializer(self.target, direction, bypass_extensions=True)
        hidden = set(self.target.staff_only_fields)
        if "required" in schema:
            schema["required"] = [name for name in schema["required"] if name not in hidden]
        return schema
