"""Beat: evaluate every active rollout (ROLLOUT_TICK_S); the state is in the database, so a worker
that restarts goes on where the rows say."""

from __future__ import annotations

from celery import shared_task


@shared_task(name="rollouts.advance_all", ignore_result=True)
def advance_all() -> dict:
    from .services import rollouts_advance_all

    return {str(pk): outcome for pk, outcome in rollouts_advance_all().items()}
