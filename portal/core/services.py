"""The one batched deletion path (docs/decisions.md, "Retention"); what it deletes is decided
above core: portal/dashboard/services.py (the daily prune) and portal/teams/services/retention.py (usage)."""

from __future__ import annotations

from typing import Any

from django.db import models


def delete_in_batches(queryset: models.QuerySet[Any], *, batch_size: int) -> int:
    """Delete what `queryset` selects, `batch_size` rows per statement (each its own short
    transaction); returns how many rows went.

    This is the portal's one deletion path for rows that are otherwise never deleted: it calls
    Django's own `QuerySet.delete`, past the audit log's refusal (`AuditEventQuerySet.delete`).
    """
    deleted = 0
    while True:
        ids = list(queryset.order_by().values_list("pk", flat=True)[:batch_size])
        if not ids:
            return deleted
        count, _ = models.QuerySet.delete(queryset.model._base_manager.filter(pk__in=ids))
        deleted += count
