"""The columns every leased job row has (the model is abstract: each job kind keeps its own table)."""

from __future__ import annotations

from django.db import models


class LeasedJob(models.Model):
    """A row a long job works on under a lease (portal/core/jobs/lease.py)."""

    # Only ever grows: bumped by every claim and by whoever ends the job out from under its holder,
    # so a worker that stalled past its lease finds a token that is no longer its own.
    lease_token = models.BigIntegerField(default=0)
    lease_owner = models.CharField(max_length=200, blank=True)
    lease_expires_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        abstract = True
