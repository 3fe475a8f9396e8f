"""Periodic gateway bookkeeping (Celery beat): flush usage records, roll them up hourly and
daily, keep the usage table's partitions ahead."""

from __future__ import annotations

from celery import shared_task


@shared_task(ignore_result=True)
def usage_flush() -> int:
    from .services import usage_flush as flush

    return flush()


@shared_task(ignore_result=True)
def usage_rollup() -> list[str]:
    """Recompute the hourly rows of each hour the flush stored records in since the last run, and
    their days' rows; then disable whoever spent today's budget."""
    from django.utils import timezone

    from .services import budgets_enforce, usage_flush, usage_rollup_recent

    usage_flush()
    usage_rollup_recent()
    return budgets_enforce(day=timezone.now().date())


@shared_task(ignore_result=True)
def usage_partitions_maintain() -> list[str]:
    """PostgreSQL: the usage table's partitions for the days ahead (and for stray rows)."""
    from .services import usage_partitions_maintain as maintain

    return [day.isoformat() for day in maintain()]
