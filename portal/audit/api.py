"""DRF glue: API writes to the inventory, registry, profiles and teams are audited in one place."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .services import audit_event_record, changed_fields, field_values

# The mixin goes before a ModelViewSet in a viewset's bases; the checker reads them as one.
if TYPE_CHECKING:
    from rest_framework.viewsets import ModelViewSet

    _ViewSet = ModelViewSet[Any]
else:
    _ViewSet = object


class AuditedModelViewSetMixin(_ViewSet):
    """Records `<model>.create|update|delete` with the fields' values (before and after on update)."""

    def _audit_name(self, instance) -> str:
        return instance._meta.model_name

    def perform_create(self, serializer) -> None:
        super().perform_create(serializer)
        instance = serializer.instance
        audit_event_record(
            action=f"{self._audit_name(instance)}.create", target=instance, changes=field_values(instance)
        )

    def perform_update(self, serializer) -> None:
        before = field_values(serializer.instance)
        super().perform_update(serializer)
        instance = serializer.instance
        audit_event_record(
            action=f"{self._audit_name(instance)}.update",
            target=instance,
            changes=changed_fields(before, field_values(instance)),
        )

    def perform_destroy(self, instance) -> None:
        name, pk, text, values = (
            self._audit_name(instance),
            str(instance.pk),
            str(instance),
            field_values(instance),
        )
        label = instance._meta.label_lower
        super().perform_destroy(instance)
        audit_event_record(
            action=f"{name}.delete", target_type=label, target_id=pk, target_repr=text, changes=values
        )
