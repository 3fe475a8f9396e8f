"""Rollouts: moving a served model's traffic from one version to another in steps, judged on the
gateway's own measurements; state in the database, driven by the `rollouts.advance_all` beat task
(docs/decisions.md, "Rollouts: steps and what a breach is")."""

from __future__ import annotations

from django.conf import settings
from django.db import models

from inference.rollout import Step


class RolloutState(models.TextChoices):
    WARMING = "warming", "warming"  # the new deployment is starting; it gets no traffic yet
    STEPPING = "stepping", "stepping"  # the new version takes the current step's share
    PAUSED = "paused", "paused"  # shares held as they are; nothing advances
    PROMOTED = "promoted", "promoted"
    ROLLED_BACK = "rolled_back", "rolled back"
    FAILED = "failed", "failed"  # the new deployment never served


ACTIVE_ROLLOUT_STATES = (RolloutState.WARMING, RolloutState.STEPPING, RolloutState.PAUSED)


class Rollout(models.Model):
    served_model = models.ForeignKey(
        "registry.ServedModel", on_delete=models.PROTECT, related_name="rollouts"
    )
    from_version = models.ForeignKey("registry.ModelVersion", on_delete=models.PROTECT, related_name="+")
    to_version = models.ForeignKey("registry.ModelVersion", on_delete=models.PROTECT, related_name="+")
    from_deployment = models.ForeignKey(
        "deployments.Deployment",
        on_delete=models.PROTECT,
        null=True,
        blank=True,
        related_name="rollouts_from",
        help_text="Asked to stop once the new version is promoted (blank: nothing is stopped).",
    )
    to_deployment = models.ForeignKey(
        "deployments.Deployment", on_delete=models.PROTECT, related_name="rollouts_to"
    )
    steps = models.JSONField(help_text='[{"share_percent": 5, "minutes": 10}, ...]; the last is 100 %.')
    current_step = models.PositiveSmallIntegerField(
        null=True, blank=True, help_text="Index; blank while warming."
    )
    state = models.CharField(max_length=12, choices=RolloutState.choices, default=RolloutState.WARMING)
    reason = models.TextField(blank=True, help_text="Why it ended (or paused), with the numbers.")
    measurements = models.JSONField(
        default=dict, blank=True, help_text="The last evaluation: the numbers and the rule that decided."
    )
    # The deployment that left the traffic (the new one on a roll-back, the old one on promotion) is
    # asked to stop one gateway route-cache interval later: until every gateway process has seen its
    # share at 0, requests may still reach it, and a stopped server would fail them.
    stop_deployment = models.ForeignKey(
        "deployments.Deployment", on_delete=models.SET_NULL, null=True, blank=True, related_name="+"
    )
    stop_due_at = models.DateTimeField(null=True, blank=True)
    # Where the new version's GPUs were held by the old one: the deployment stopped at the start to
    # free them (a replica taken out of the pool, or the old one in an in-place swap), started
    # again if the rollout rolls back or fails.
    freed_deployment = models.ForeignKey(
        "deployments.Deployment", on_delete=models.SET_NULL, null=True, blank=True, related_name="+"
    )
    downtime_s = models.PositiveIntegerField(
        null=True, blank=True, help_text="An in-place swap's downtime as stated at the start."
    )
    # The rollout's own pace (from ROLLOUT_TICK_S and ROLLOUT_MIN_REQUESTS at its start): how often
    # a step is judged, and the requests a step needs before it may pass.
    interval_s = models.PositiveIntegerField(default=15, help_text="Seconds between two measurements.")
    min_requests = models.PositiveIntegerField(default=20)
    compare_sla_only = models.BooleanField(
        default=False,
        help_text="Judge the new version on the SLA and the error ceiling only, not against the old "
        "version (for a canary on other hardware).",
    )
    evaluated_at = models.DateTimeField(
        null=True, blank=True, help_text="The current step's last measurement."
    )
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, blank=True, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    step_started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["-created_at"]
        constraints = [
            # One rollout at a time per served name: two would fight over its shares.
            models.UniqueConstraint(
                fields=["served_model"],
                condition=models.Q(state__in=["warming", "stepping", "paused"]),
                name="rollout_one_active_per_served_model",
            )
        ]

    def __str__(self) -> str:
        return f"{self.served_model_id}: {self.from_version_id} → {self.to_version_id} ({self.state})"

    @property
    def is_active(self) -> bool:
        return self.state in ACTIVE_ROLLOUT_STATES

    def step_list(self) -> list[Step]:
        return [Step(s["share_percent"], s.get("minutes", 0), s.get("seconds", 0)) for s in self.steps]


class RolloutEvent(models.Model):
    """One line of a rollout's timeline: every step and decision, by whom, with the numbers."""

    rollout = models.ForeignKey(Rollout, on_delete=models.CASCADE, related_name="events")
    at = models.DateTimeField(auto_now_add=True)
    kind = models.CharField(max_length=20)  # start, serving, step, pause, resume, promote, roll_back, fail
    message = models.CharField(max_length=500)
    data = models.JSONField(default=dict, blank=True)
    actor_repr = models.CharField(max_length=150, default="system")

    class Meta:
        ordering = ["at", "pk"]

    def __str__(self) -> str:
        return f"{self.rollout_id} {self.kind}: {self.message}"
