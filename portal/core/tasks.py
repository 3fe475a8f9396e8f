"""Beat: the daily retention prune (portal/core/services.py)."""

from __future__ import annotations

from celery import shared_task


@shared_task(name="core.retention_prune", ignore_result=True)
def retention_prune() -> dict[str, int]:
    from .services import retention_prune as prune

    return prune()
