"""Teams, their API keys and quotas, and the gateway's usage records.

A team owns deployments and API keys. Quotas live on the team and, optionally,
tighter ones on a key (blank = no per-key limit). Keys are stored as a public
prefix plus an HMAC-SHA256 of the whole key; the secret itself is never stored.
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import MinValueValidator, RegexValidator
from django.db import models
from django.utils import timezone

from portal.inventory.models import ACCEPTANCE_TEAM_SLUG

# Largest values of the quota columns (PostgreSQL integer and bigint); forms and services refuse more.
INT_MAX = 2**31 - 1
BIGINT_MAX = 2**63 - 1


class PriorityClass(models.TextChoices):
    """How the gateway admits a team's (or key's) requests to a deployment.

    Interactive requests take any free slot and queue first; batch requests take only spare
    capacity (below a share of the deployment's cap), wait in their own queue with a longer
    deadline, and are never placed ahead of an interactive request.
    """

    INTERACTIVE = "interactive", "interactive"
    BATCH = "batch", "batch"


class QuotaFields(models.Model):
    """Request quotas shared by teams and keys; blank means "no limit at this level"."""

    rpm_limit = models.PositiveIntegerField(
        null=True, blank=True, validators=[MinValueValidator(1)], help_text="Requests per minute."
    )
    tpm_limit = models.PositiveIntegerField(
        null=True,
        blank=True,
        validators=[MinValueValidator(1)],
        help_text="Tokens (prompt + completion) per minute.",
    )
    tokens_per_day = models.PositiveBigIntegerField(
        null=True, blank=True, validators=[MinValueValidator(1)], help_text="Tokens per UTC day."
    )
    max_concurrent = models.PositiveIntegerField(
        null=True, blank=True, validators=[MinValueValidator(1)], help_text="Requests in flight at once."
    )
    # Set by the daily rollup when the budget is spent; cleared at the next UTC midnight.
    disabled_until = models.DateTimeField(null=True, blank=True)
    disabled_reason = models.CharField(max_length=200, blank=True)

    class Meta:
        abstract = True

    def is_disabled(self, now=None) -> bool:
        return self.disabled_until is not None and self.disabled_until > (now or timezone.now())


# Slugs of the teams the portal keeps for itself (`Team.system`): node acceptance's reference
# deployments live in "acceptance". No team of users may take one.
RESERVED_TEAM_SLUGS = frozenset({ACCEPTANCE_TEAM_SLUG})


class Team(QuotaFields):
    name = models.CharField(max_length=100, unique=True)
    slug = models.SlugField(max_length=50, unique=True)
    members = models.ManyToManyField(settings.AUTH_USER_MODEL, related_name="teams", blank=True)
    gpu_quota = models.PositiveIntegerField(
        default=0,
        validators=[MinValueValidator(0)],
        help_text="How many GPUs this team's running deployments may hold at once.",
    )
    # docs/v100-field-guide.md#gateway-rules: clamp max_tokens so a few long generations
    # cannot hold batch slots.
    max_tokens_clamp = models.PositiveIntegerField(
        default=1024, validators=[MinValueValidator(1)], help_text="Largest max_tokens a request may ask for."
    )
    allowed_models = models.JSONField(
        default=list, blank=True, help_text="Model names the team may call (empty: every served model)."
    )
    priority_class = models.CharField(
        max_length=12,
        choices=PriorityClass.choices,
        default=PriorityClass.INTERACTIVE,
        help_text="How the gateway admits this team's requests (a key may override it).",
    )
    # Hours when the team's batches run, "HH:MM-HH:MM" in the portal's time zone (blank: the portal's
    # BATCH_RUN_WINDOW, itself blank for "always").
    batch_run_window = models.CharField(
        max_length=11,
        blank=True,
        validators=[RegexValidator(r"^([01]\d|2[0-3]):[0-5]\d-([01]\d|2[0-3]):[0-5]\d$", "Use HH:MM-HH:MM.")],
        help_text="Hours when this team's batches run, e.g. 20:00-07:00 (blank: the portal's window).",
    )
    # The portal's own team (node acceptance's reference deployments): made by the portal only,
    # under a reserved slug that no other team may take.
    system = models.BooleanField(default=False, editable=False)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    # get_absolute_url: the team's overview is deployments' (settings.ABSOLUTE_URL_OVERRIDES).
    if TYPE_CHECKING:

        def get_absolute_url(self) -> str: ...

        _audit_quotas_before: dict[str, Any] | None  # the quotas before a save (teams/signals.py)

    def clean(self) -> None:
        super().clean()
        if self.slug in RESERVED_TEAM_SLUGS and not self.system:
            raise ValidationError({"slug": f"“{self.slug}” is reserved for the portal's own team."})


class ApiKey(QuotaFields):
    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="api_keys")
    name = models.CharField(max_length=100, blank=True, help_text="What the key is for.")
    # The public part of the key (`sk-<prefix>.<secret>`): shown in lists, used to find the row.
    prefix = models.CharField(max_length=16, unique=True, editable=False)
    # HMAC-SHA256 of the whole key under GATEWAY_KEY_HMAC_SECRET (hex); never the key itself.
    digest = models.CharField(max_length=64, editable=False)
    allowed_models = models.JSONField(
        default=list, blank=True, help_text="Model names this key may call (empty: the team's models)."
    )
    priority_class = models.CharField(
        max_length=12,
        choices=PriorityClass.choices,
        blank=True,
        help_text="How the gateway admits this key's requests (blank: the team's class).",
    )
    # Who chose `priority_class`: staff (or a shell command) may give a key any class; a member's
    # choice never lifts the key above its team's class, whenever staff change that class.
    priority_class_set_by_staff = models.BooleanField(
        default=False,
        help_text="The key's class was set by staff: it holds even above the team's class.",
    )
    expires_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    # Set on the one key per (team, member) that the playground page calls the gateway with: the
    # member's session stands for it, its secret is never shown, and key lists leave it out.
    playground_user = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        editable=False,
        on_delete=models.CASCADE,
        related_name="playground_keys",
    )
    # Set on the one key per (team, member) that the member's benchmark runs call the gateway with:
    # their usage is the team's, marked as benchmark traffic by this key. Each run gives it a new
    # secret, held only in the benchmark worker's memory; key lists leave it out.
    benchmark_user = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        editable=False,
        on_delete=models.CASCADE,
        related_name="benchmark_keys",
    )
    # The one deployment this key's requests may go to (a benchmark measures one deployment, not
    # whichever replica of its model is free); null: any the team may use. An id rather than a
    # foreign key: a deleted deployment leaves the key pinned to nothing, never unpinned.
    pinned_deployment_id = models.PositiveBigIntegerField(null=True, blank=True, editable=False)

    class Meta:
        ordering = ["-created_at"]
        verbose_name = "API key"
        constraints = [
            models.UniqueConstraint(
                fields=["team", "playground_user"],
                condition=models.Q(playground_user__isnull=False),
                name="one_playground_key_per_team_member",
            ),
            models.UniqueConstraint(
                fields=["team", "benchmark_user"],
                condition=models.Q(benchmark_user__isnull=False),
                name="one_benchmark_key_per_team_member",
            ),
        ]

    def __str__(self) -> str:
        return f"sk-{self.prefix}…"

    def effective_priority_class(self, team: Team | None = None) -> str:
        """The class the gateway admits this key's requests in: the key's own when staff set it;
        otherwise the lower of the member's choice and the team's (batch is below interactive), so
        demoting a team demotes every key its members made interactive."""
        team_class = (team or self.team).priority_class
        if self.priority_class and self.priority_class_set_by_staff:
            return self.priority_class
        if PriorityClass.BATCH in (self.priority_class, team_class):
            return PriorityClass.BATCH
        return team_class

    @property
    def source(self) -> str:
        """Whose traffic the key carries: a member's "playground" or "benchmark" runs, else "key"."""
        return source_of_key(self.playground_user_id, self.benchmark_user_id)

    @property
    def is_active(self) -> bool:
        now = timezone.now()
        return (
            self.revoked_at is None
            and (self.expires_at is None or self.expires_at > now)
            and not self.is_disabled(now)
        )


def source_of_key(playground_user_id: int | None, benchmark_user_id: int | None) -> str:
    if benchmark_user_id is not None:
        return "benchmark"
    return "playground" if playground_user_id is not None else "key"


class UsageStatus(models.TextChoices):
    COMPLETED = "completed", "completed"
    CLIENT_CANCELLED = "client_cancelled", "client cancelled"
    UPSTREAM_ERROR = "upstream_error", "upstream error"
    # Refused for what the caller did (a quota, a rate limit, a bad request), as against UNAVAILABLE:
    # the portal could not serve it (no replica, queue timeout, its Redis or database down). A member
    # reading the usage page must not take an outage for a quota they hit (issue 38).
    REJECTED = "rejected", "refused (quota, rate limit, bad request)"
    TIMEOUT = "timeout", "timeout"
    UNAVAILABLE = "unavailable", "outage (no replica or the portal unavailable)"
    # The gateway process serving it died (killed, crashed): billed its reservation, as its daily
    # counters still hold it (docs/concurrency.md, "Requests whose gateway process died").
    INTERRUPTED = "interrupted", "interrupted"


# Outcomes in which nothing ran on an engine: their tokens are never billed, counted toward a daily
# budget or shown as tokens used (the gateway's counter, its rebuild, the rollups and the pages).
UNBILLED_STATUSES = frozenset({UsageStatus.REJECTED, UsageStatus.UNAVAILABLE})
# The usage records whose tokens count, as a filter for a sum: `Sum("prompt_tokens", filter=BILLED)`.
BILLED = ~models.Q(status__in=UNBILLED_STATUSES)


class UsageSource(models.TextChoices):
    """What sent the request: a client through the gateway's HTTP API, or a batch line the portal ran."""

    GATEWAY = "gateway", "gateway"
    BATCH = "batch", "batch"


class Usage(models.Model):
    """One row per gateway request that got past authentication, whatever its outcome.

    On PostgreSQL the table is partitioned by UTC day of `created_at` (migration 0006,
    `portal/teams/partitions.py`): the primary key is (id, created_at) there, and a request is
    stored once per (request_id, created_at), which a replayed record repeats exactly (both come
    from the gateway's record). Retention drops whole days. No foreign-key constraints in the
    database: the flush checks team, key and deployment itself, and a constraint would cost a
    lookup per inserted row at 2,000 rows/s; Django still applies `on_delete`.
    """

    request_id = models.UUIDField(default=uuid.uuid4, editable=False)
    created_at = models.DateTimeField(db_index=True, help_text="When the request arrived.")
    # No index of its own: (team, created_at) below serves every lookup by team.
    team = models.ForeignKey(
        Team, on_delete=models.CASCADE, related_name="usage", db_constraint=False, db_index=False
    )
    api_key = models.ForeignKey(
        ApiKey, null=True, on_delete=models.SET_NULL, related_name="usage", db_constraint=False
    )
    model = models.CharField(max_length=100, blank=True)
    deployment = models.ForeignKey(
        "deployments.Deployment",
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="+",
        db_constraint=False,
    )
    endpoint = models.CharField(max_length=30, blank=True)
    priority_class = models.CharField(
        max_length=12, choices=PriorityClass.choices, default=PriorityClass.INTERACTIVE
    )
    stream = models.BooleanField(default=False)
    status = models.CharField(max_length=20, choices=UsageStatus.choices)
    http_status = models.PositiveSmallIntegerField()
    error_code = models.CharField(max_length=50, blank=True)
    prompt_tokens = models.PositiveIntegerField(default=0)
    completion_tokens = models.PositiveIntegerField(default=0)
    ttft_ms = models.FloatField(null=True, blank=True)
    duration_ms = models.FloatField()
    source = models.CharField(max_length=12, choices=UsageSource.choices, default=UsageSource.GATEWAY)
    # The batch's public id (`batch_…`) for a batch line's row: by id, not a foreign key, as batches
    # sit above teams (docs/architecture.md#layers).
    batch_id = models.CharField(max_length=40, blank=True, default="")

    class Meta:
        ordering = ["-created_at"]
        indexes = [models.Index(fields=["team", "created_at"])]
        constraints = [
            # PostgreSQL wants the partition key in every unique constraint of a partitioned table.
            models.UniqueConstraint(fields=["request_id", "created_at"], name="usage_request_once"),
        ]

    def __str__(self) -> str:
        return f"{self.request_id} {self.status}"


class UsageTotals(models.Model):
    """The sums a usage rollup keeps per period, team, key, model and priority class."""

    model = models.CharField(max_length=100, blank=True)
    priority_class = models.CharField(
        max_length=12, choices=PriorityClass.choices, default=PriorityClass.INTERACTIVE
    )
    requests = models.PositiveIntegerField(default=0)
    completed = models.PositiveIntegerField(default=0)
    rejected = models.PositiveIntegerField(default=0, help_text="Refused: quotas, rate limits, bad requests.")
    unavailable = models.PositiveIntegerField(
        default=0,
        help_text="Outages: no replica serving, a queue timeout, the portal's Redis or database down.",
    )
    failed = models.PositiveIntegerField(default=0, help_text="Upstream errors, timeouts and cancellations.")
    # Billed tokens only: a refused or unavailable request's prompt ran nowhere (UNBILLED_STATUSES).
    prompt_tokens = models.PositiveBigIntegerField(default=0)
    completion_tokens = models.PositiveBigIntegerField(default=0)

    class Meta:
        abstract = True

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class UsageHourly(UsageTotals):
    """Usage summed per UTC hour, team, key, model and priority class; kept forever.

    Recomputed from the usage records of each hour the flush wrote to (`usage_rollup_hours`);
    the daily rows are summed from these. Pages read these, not the records.
    """

    hour = models.DateTimeField(help_text="Start of the UTC hour.")
    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="usage_hourly")
    api_key = models.ForeignKey(ApiKey, null=True, on_delete=models.SET_NULL, related_name="usage_hourly")

    class Meta:
        ordering = ["-hour", "team"]
        indexes = [models.Index(fields=["team", "hour"]), models.Index(fields=["hour"])]
        verbose_name_plural = "usage (hourly)"

    def __str__(self) -> str:
        return f"{self.hour:%Y-%m-%d %H}h {self.team_id} {self.model}"


class UsageDaily(UsageTotals):
    """Usage summed per UTC day, team, key, model and priority class (recomputed by the rollup task)."""

    day = models.DateField()
    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="usage_daily")
    api_key = models.ForeignKey(ApiKey, null=True, on_delete=models.SET_NULL, related_name="usage_daily")
    closed = models.BooleanField(
        default=False,
        help_text="The day's usage records are being or have been deleted (retention): never recomputed.",
    )

    class Meta:
        ordering = ["-day", "team"]
        indexes = [models.Index(fields=["team", "day"])]
        verbose_name_plural = "usage (daily)"

    def __str__(self) -> str:
        return f"{self.day} {self.team_id} {self.model}"
