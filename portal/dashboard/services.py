"""Retention: what the daily prune deletes, and how (docs/decisions.md, "Retention").

It lives on top because it reaches into several apps (audit, deployments, teams); the batched
delete itself is core's `delete_in_batches`.
"""

from __future__ import annotations

import datetime as dt
import logging

from django.conf import settings
from django.utils import timezone

from portal.audit.models import AuditEvent
from portal.batches.services import batches_prune
from portal.core.services import delete_in_batches
from portal.deployments.models import DeploymentEvent, MetricsSample
from portal.inventory.models import GpuSample
from portal.teams.services import usage_prune

logger = logging.getLogger("portal.retention")


def retention_prune(*, now: dt.datetime | None = None) -> dict[str, int]:
    """Delete rows older than their retention setting (0 keeps forever); returns the counts."""
    now = now or timezone.now()
    batch = settings.RETENTION_BATCH_SIZE
    done: dict[str, int] = {}
    if settings.RETENTION_USAGE_DAYS:
        # Whole UTC days: a day's daily rollup is computed from all of its records or none.
        before = (now - dt.timedelta(days=settings.RETENTION_USAGE_DAYS)).astimezone(dt.UTC).date()
        done["usage"] = usage_prune(before=before, batch_size=batch)
    for key, model, days in [
        ("deployment_events", DeploymentEvent, settings.RETENTION_DEPLOYMENT_EVENTS_DAYS),
        ("metrics_samples", MetricsSample, settings.RETENTION_METRICS_SAMPLES_DAYS),
        ("audit_events", AuditEvent, settings.RETENTION_AUDIT_DAYS),
        ("gpu_samples", GpuSample, settings.RETENTION_GPU_SAMPLES_DAYS),
    ]:
        if days:
            old = model._base_manager.filter(at__lt=now - dt.timedelta(days=days))
            done[key] = delete_in_batches(old, batch_size=batch)
    # Batch files carry their own expiry (BATCH_FILE_RETENTION_DAYS, stamped when each was made).
    done["batch_files"] = batches_prune(now=now, batch_size=batch)
    logger.info("retention: deleted %s", ", ".join(f"{n} {k}" for k, n in done.items()) or "nothing")
    return done
