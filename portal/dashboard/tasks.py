"""Beat: the daily retention prune (portal/dashboard/services.py)."""

from __future__ import annotations

from celery import shared_task


@shared_task(name="dashboard.retention_prune", ignore_result=True)
def retention_prune() -> dict[str, int]:
    from .services import retention_prune as prune

    return prune()
