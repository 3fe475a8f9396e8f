"""Benchmark runs and their per-level results.

A run targets a deployment (its endpoint and served model name) or any
registered OpenAI-compatible endpoint. It keeps a snapshot of what was measured
(profile settings, model version, node, GPUs, vLLM version) so history stays
readable after the deployment changes or is gone. Levels are saved one by one
as they finish: a crash loses at most the running level.
"""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.urls import reverse

from portal.core.jobs.models import LeasedJob


class RunState(models.TextChoices):
    QUEUED = "queued", "queued"
    RUNNING = "running", "running"
    DONE = "done", "done"
    PARTIAL = "partial", "partial (stopped early)"
    FAILED = "failed", "failed"
    CANCELLED = "cancelled", "cancelled"


FINISHED_STATES = (RunState.DONE, RunState.PARTIAL, RunState.FAILED, RunState.CANCELLED)


class RunKind(models.TextChoices):
    MEASURED = "measured", "measured here"
    IMPORTED = "imported", "imported table"


class BenchmarkRun(LeasedJob):
    kind = models.CharField(max_length=10, choices=RunKind.choices, default=RunKind.MEASURED)
    title = models.CharField(max_length=200, blank=True)
    deployment = models.ForeignKey(
        "deployments.Deployment",
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="benchmark_runs",
    )
    # Kept apart from the snapshot so history per profile survives a deployment's deletion.
    profile = models.ForeignKey(
        "deployments.DeploymentProfile",
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="benchmark_runs",
    )
    endpoint_url = models.URLField(blank=True, help_text="Server root (no /v1).")
    model_name = models.CharField(max_length=200, blank=True, help_text="Served model name.")

    mix = models.CharField(max_length=300, help_text="Preset name, fixed:<in>:<out>, or a mix file.")
    mix_definition = models.JSONField(default=dict, blank=True)
    config = models.JSONField(default=dict, blank=True, help_text="Levels, counts, seed, timeouts.")
    snapshot = models.JSONField(default=dict, blank=True)
    sla_p95_ttft_s = models.FloatField(default=3.0)
    sla_p95_tpot_s = models.FloatField(default=0.2)

    state = models.CharField(max_length=10, choices=RunState.choices, default=RunState.QUEUED)
    state_reason = models.TextField(blank=True)
    cancel_requested = models.BooleanField(default=False)
    progress = models.JSONField(default=dict, blank=True)
    # The lease (LeasedJob: portal/core/jobs, docs/jobs.md): a running job renews it; a redelivered
    # task may take over only after it expires, with the next fencing token.

    prompt_source = models.CharField(max_length=300, blank=True)
    prompt_tokens_exact = models.BooleanField(default=False)
    sla_concurrency = models.PositiveIntegerField(null=True, blank=True)
    sla_reason = models.TextField(blank=True)
    notes = models.TextField(blank=True)

    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [
            models.Index(fields=["deployment", "-created_at"]),
            models.Index(fields=["profile", "-created_at"]),
        ]

    def __str__(self) -> str:
        return f"benchmark run {self.pk}"

    def get_absolute_url(self) -> str:
        return reverse("benchmarks:run-detail", args=[self.pk])

    @property
    def finished(self) -> bool:
        return self.state in FINISHED_STATES

    @property
    def sla_text(self) -> str:
        return f"P95 TTFT ≤ {self.sla_p95_ttft_s:g} s and P95 TPOT ≤ {self.sla_p95_tpot_s:g} s"

    @property
    def target_name(self) -> str:
        if self.deployment is not None:
            return self.deployment.name
        return self.snapshot.get("deployment") or self.endpoint_url or self.title or "—"


class BenchmarkLevel(models.Model):
    run = models.ForeignKey(BenchmarkRun, on_delete=models.CASCADE, related_name="levels")
    index = models.PositiveSmallIntegerField()
    concurrency = models.PositiveIntegerField(null=True, blank=True)
    request_rate = models.FloatField(null=True, blank=True)
    # The level dict under vLLM's key names (inference.loadgen.summary.summarize_level), plus
    # the server's and the client's readings, the Little's-law check and the roofline share.
    results = models.JSONField(default=dict)
    # Per-request TTFT/TPOT/E2EL (ms) for the distribution plot; kept apart: large.
    samples = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["run", "index"]
        constraints = [models.UniqueConstraint(fields=["run", "index"], name="benchmark_level_unique_index")]

    def __str__(self) -> str:
        return f"run {self.run_id} level {self.index}"
