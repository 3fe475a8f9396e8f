"""Production latency per deployment per minute (rolled up from the gateway's usage records), and
the SLA breaches found in it. Both are kept as long as daily usage: forever (docs/decisions.md,
"Production latency rollups and SLA breaches")."""

from __future__ import annotations

from django.db import models


class LatencyMinute(models.Model):
    """One deployment's gateway requests that arrived in one UTC minute: counts and percentiles.

    Recomputed from the minute's Usage rows by `latency_rollup` (idempotent per deployment and
    minute). TTFT and TPOT come from streamed requests only (a non-streamed answer arrives whole:
    it has no first token to time); TPOT of a request = (duration - TTFT) / (completion tokens - 1),
    for completed ones with at least two completion tokens. End-to-end latency (arrival to last
    byte) counts every completed request, streamed or not.
    """

    deployment = models.ForeignKey(
        "deployments.Deployment", on_delete=models.CASCADE, related_name="latency_minutes"
    )
    minute = models.DateTimeField(help_text="Start of the UTC minute.")
    requests = models.PositiveIntegerField(default=0)
    errors = models.PositiveIntegerField(default=0, help_text="Upstream errors and timeouts.")
    p50_ttft_ms = models.FloatField(null=True, blank=True)
    p95_ttft_ms = models.FloatField(null=True, blank=True)
    p50_tpot_ms = models.FloatField(null=True, blank=True)
    p95_tpot_ms = models.FloatField(null=True, blank=True)
    p50_e2e_ms = models.FloatField(null=True, blank=True, help_text="End-to-end, completed requests.")
    p95_e2e_ms = models.FloatField(null=True, blank=True, help_text="End-to-end, completed requests.")

    class Meta:
        ordering = ["deployment", "minute"]
        constraints = [
            models.UniqueConstraint(fields=["deployment", "minute"], name="latency_minute_unique_minute")
        ]

    def __str__(self) -> str:
        return f"{self.deployment_id} {self.minute:%Y-%m-%d %H:%M}"


class SlaBreach(models.Model):
    """A stretch of minutes in which a deployment's P95 TTFT or P95 TPOT broke its SLA: opened after
    SLA_BREACH_MINUTES breaking minutes in a row, closed at the first minute that does not break."""

    deployment = models.ForeignKey(
        "deployments.Deployment", on_delete=models.CASCADE, related_name="sla_breaches"
    )
    started_at = models.DateTimeField(help_text="Start of the first breaking minute.")
    ended_at = models.DateTimeField(null=True, blank=True, help_text="End of the last breaking minute.")
    reason = models.CharField(max_length=300, blank=True, help_text="What broke, at the opening.")

    class Meta:
        ordering = ["-started_at"]
        constraints = [
            # At most one open breach per deployment: two overlapping evaluations cannot open two.
            models.UniqueConstraint(
                fields=["deployment"], condition=models.Q(ended_at__isnull=True), name="sla_breach_one_open"
            )
        ]

    def __str__(self) -> str:
        return f"{self.deployment_id} breach from {self.started_at:%Y-%m-%d %H:%M}"

    @property
    def is_open(self) -> bool:
        return self.ended_at is None
