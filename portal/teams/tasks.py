"""Periodic gateway bookkeeping (Celery beat): flush usage records, roll them up daily."""

from __future__ import annotations

import datetime as dt

from celery import shared_task


@shared_task(ignore_result=True)
def usage_flush() -> int:
    from .services import usage_flush as flush

    return flush()


@shared_task(ignore_result=True)
def usage_rollup() -> list[str]:
    """Recompute today's and yesterday's daily rows (late records land in yesterday) and
    disable whoever spent today's budget."""
    from django.utils import timezone

    from .services import budgets_enforce, usage_flush, usage_rollup

    usage_flush()
    today = timezone.now().date()
    usage_rollup(day=today - dt.timedelta(days=1))
    usage_rollup(day=today)
    return budgets_enforce(day=today)
