"""Deployment profiles (vLLM launch settings) and deployments (a profile placed on GPUs)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from django.core.exceptions import NON_FIELD_ERRORS, ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models
from django.urls import reverse

from inference.errors import InputError
from inference.hardware import get_gpu
from portal.core.errors import ApplicationError
from portal.core.jobs.models import LeasedJob

if TYPE_CHECKING:
    from portal.inventory.models import Node


class Dtype(models.TextChoices):
    FLOAT16 = "float16", "float16"
    BFLOAT16 = "bfloat16", "bfloat16"
    FLOAT32 = "float32", "float32"
    AUTO = "auto", "auto (from the checkpoint)"


class Engine(models.TextChoices):
    """What serves a deployment: the real vLLM, or the V100 simulator (same flags, same API)."""

    VLLM = "vllm", "vLLM"
    SIM = "sim", "simulator (inference.sim)"


class DeploymentProfile(models.Model):
    """Every vLLM knob that docs/v100-field-guide.md#launch-settings found to matter, plus extras."""

    name = models.SlugField(max_length=100, unique=True)
    description = models.CharField(max_length=255, blank=True)
    # What the profile was tuned for; the planner checks it against this target
    # on the profile page. A deployment is checked again against its real node.
    model_version = models.ForeignKey(
        "registry.ModelVersion", on_delete=models.PROTECT, null=True, blank=True, related_name="profiles"
    )
    target_gpu = models.CharField(
        max_length=50, blank=True, help_text="GPU catalog key, e.g. v100-sxm2-32gb."
    )
    target_gpu_count = models.PositiveSmallIntegerField(default=1, validators=[MinValueValidator(1)])

    dtype = models.CharField(max_length=10, choices=Dtype.choices, default=Dtype.FLOAT16)
    tensor_parallel_size = models.PositiveSmallIntegerField(
        default=1, validators=[MinValueValidator(1), MaxValueValidator(64)]
    )
    max_model_len = models.PositiveIntegerField(
        null=True,
        blank=True,
        validators=[MinValueValidator(1), MaxValueValidator(10_000_000)],
        help_text="Blank: the model's maximum positions.",
    )
    gpu_memory_utilization = models.FloatField(
        default=0.9, validators=[MinValueValidator(0.05), MaxValueValidator(1.0)]
    )
    max_num_seqs = models.PositiveIntegerField(
        default=256, validators=[MinValueValidator(1), MaxValueValidator(65_536)]
    )
    max_num_batched_tokens = models.PositiveIntegerField(
        null=True, blank=True, validators=[MinValueValidator(1), MaxValueValidator(10_000_000)]
    )
    block_size = models.PositiveSmallIntegerField(
        default=16, choices=[(8, "8"), (16, "16"), (32, "32"), (64, "64"), (128, "128")]
    )
    enable_prefix_caching = models.BooleanField(default=False)
    enable_chunked_prefill = models.BooleanField(default=False)
    enforce_eager = models.BooleanField(default=False)
    quantization = models.CharField(max_length=30, blank=True, help_text="Blank: none (or from the model).")
    swap_space_gb = models.FloatField(default=4.0, validators=[MinValueValidator(0), MaxValueValidator(1024)])
    kv_cache_dtype = models.CharField(max_length=10, default="auto")
    extra_args = models.JSONField(
        default=list, blank=True, help_text='More vLLM flags, e.g. ["--seed", "0"].'
    )
    engine = models.CharField(
        max_length=10, choices=Engine.choices, blank=True, help_text="Blank: the node's engine."
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]
        # The fields' validators, for writes that skip them: none of these may switch a limit off.
        constraints = [
            models.CheckConstraint(
                condition=models.Q(
                    target_gpu_count__gte=1,
                    tensor_parallel_size__gte=1,
                    tensor_parallel_size__lte=64,
                    gpu_memory_utilization__gte=0.05,
                    gpu_memory_utilization__lte=1.0,
                    max_num_seqs__gte=1,
                    max_num_seqs__lte=65_536,
                    swap_space_gb__gte=0,
                    swap_space_gb__lte=1024,
                ),
                name="profile_numbers_bounded",
                violation_error_message="A profile number is out of its bounds.",
            ),
            models.CheckConstraint(
                condition=(models.Q(max_model_len__isnull=True) | models.Q(max_model_len__gte=1))
                & (models.Q(max_num_batched_tokens__isnull=True) | models.Q(max_num_batched_tokens__gte=1)),
                name="profile_lengths_at_least_1",
                violation_error_message="Lengths and token budgets must be at least 1 (blank: default).",
            ),
        ]

    def __str__(self) -> str:
        return self.name

    def get_absolute_url(self) -> str:
        return reverse("deployments:profile-detail", args=[self.name])

    def clean(self) -> None:
        from .launch import launch_settings  # launch reads this model; it is imported only to check it

        try:
            launch_settings(self)
        except ApplicationError as error:
            field = error.field if error.field in {f.name for f in self._meta.fields} else NON_FIELD_ERRORS
            raise ValidationError({field: error.message}) from error
        if self.target_gpu:
            try:
                self.target_gpu = get_gpu(self.target_gpu).key
            except InputError as error:
                raise ValidationError({"target_gpu": error.message}) from error
        if not all(isinstance(arg, str) for arg in self.extra_args or []):
            raise ValidationError({"extra_args": "a list of strings, one per argv item"})

    @property
    def target_gpu_name(self) -> str:
        return get_gpu(self.target_gpu).display_name if self.target_gpu else ""


def served_context_len(
    *, profile_max_model_len: int | None, max_position_embeddings: int, external: bool
) -> int | None:
    """The context a server of this model runs with (vLLM's max_model_len): the profile's, else the
    model's positions. None when unknown: an adopted server whose /v1/models gave no length is
    recorded with a placeholder of 1 (registry.services.model_version_record_external)."""
    if profile_max_model_len:
        return profile_max_model_len
    if external and max_position_embeddings <= 1:
        return None
    return max_position_embeddings


class DesiredState(models.TextChoices):
    RUNNING = "running", "running"
    STOPPED = "stopped", "stopped"


class DeploymentState(models.TextChoices):
    """What the node agent last reported. The lifecycle tasks move it; nothing else does."""

    PENDING = "pending", "pending"
    STARTING = "starting", "starting"
    SERVING = "serving", "serving"
    DRAINING = "draining", "draining"
    STOPPING = "stopping", "stopping"
    STOPPED = "stopped", "stopped"
    FAILED = "failed", "failed"


class GpuFailurePolicy(models.TextChoices):
    """What happens to a deployment whose GPU turns degraded or lost (docs/decisions.md)."""

    MOVE = "move", "move to healthy GPUs (kept and flagged where there are none)"
    KEEP = "keep", "keep it where it is and flag it"


class Deployment(LeasedJob):
    name = models.SlugField(max_length=100, unique=True)
    team = models.ForeignKey("teams.Team", on_delete=models.PROTECT, related_name="deployments")
    model_version = models.ForeignKey(
        "registry.ModelVersion", on_delete=models.PROTECT, related_name="deployments"
    )
    # Both are empty only for an adopted server (`adopted`): one the portal did not start.
    profile = models.ForeignKey(
        DeploymentProfile, on_delete=models.PROTECT, related_name="deployments", null=True, blank=True
    )
    node = models.ForeignKey(
        "inventory.Node", on_delete=models.PROTECT, related_name="deployments", null=True, blank=True
    )
    gpu_indices = models.JSONField(default=list, blank=True, help_text="GPUs of the node it runs on.")
    desired_state = models.CharField(
        max_length=10, choices=DesiredState.choices, default=DesiredState.STOPPED
    )
    state = models.CharField(max_length=10, choices=DeploymentState.choices, default=DeploymentState.PENDING)
    state_reason = models.TextField(blank=True)
    endpoint_url = models.URLField(blank=True)
    # At least 1: a cap of 0 once meant "no cap" to the gateway's admission script (docs/decisions.md).
    concurrency_cap = models.PositiveIntegerField(
        null=True,
        blank=True,
        validators=[MinValueValidator(1)],
        help_text="Gateway cap on in-flight requests, at least 1 (blank: none).",
    )
    # Where the cap came from ("set by alice", "benchmark run 12 at P95 SLA"), shown next to it.
    concurrency_cap_source = models.CharField(max_length=255, blank=True)
    # The SLA that benchmark runs of this deployment are judged by (defaults from
    # docs/v100-field-guide.md#measuring).
    sla_p95_ttft_s = models.FloatField(
        default=3.0, validators=[MinValueValidator(0.001), MaxValueValidator(600)]
    )  # services.SLA_TTFT_MAX_S
    sla_p95_tpot_s = models.FloatField(
        default=0.2, validators=[MinValueValidator(0.0001), MaxValueValidator(60)]
    )  # services.SLA_TPOT_MAX_S
    gpu_failure_policy = models.CharField(
        max_length=10,
        choices=GpuFailurePolicy.choices,
        default=GpuFailurePolicy.MOVE,
        help_text="When one of its GPUs turns degraded or lost.",
    )
    # A server the portal did not start (register_endpoint): health-checked and
    # routed to, never started or stopped.
    adopted = models.BooleanField(default=False)
    # The gateway routes a team's keys to its own deployments only, plus those ops share.
    shared = models.BooleanField(
        default=False,
        help_text="Every team's keys may call it through the gateway (else only its own team's).",
    )

    # The bearer token the server wants on /v1/* (vLLM's VLLM_API_KEY, given in its environment).
    # A secret: never in an API, page, form, log or audit event (docs/decisions.md, engine API keys).
    engine_api_key = models.CharField(max_length=200, blank=True, editable=False)

    # --- What the node agent launched (written under the deployment's lease) ---
    engine_used = models.CharField(max_length=10, blank=True, help_text="Engine of the last launch.")
    command = models.JSONField(default=list, blank=True, help_text="argv of the last launch.")
    port = models.PositiveIntegerField(null=True, blank=True)
    pid = models.PositiveIntegerField(null=True, blank=True)
    pgid = models.PositiveIntegerField(null=True, blank=True)
    # Boot id, start time and command line of the pid when launched (supervisor.ProcessIdentity):
    # a pid or pgid is only signalled while it is still that process.
    process_identity = models.JSONField(default=dict, blank=True, editable=False)
    run_dir = models.CharField(max_length=500, blank=True)
    log_path = models.CharField(max_length=500, blank=True)
    log_tail = models.TextField(blank=True, help_text="Last lines of the server log, as the agent read them.")
    failure_code = models.CharField(max_length=50, blank=True, help_text="Classified startup failure.")
    start_requested_at = models.DateTimeField(null=True, blank=True)
    launched_at = models.DateTimeField(null=True, blank=True)
    serving_since = models.DateTimeField(null=True, blank=True)

    # --- Supervision -------------------------------------------------------------
    restart_count = models.PositiveIntegerField(default=0, help_text="Automatic restarts in a row.")
    health_failures = models.PositiveIntegerField(default=0, help_text="Failed health checks in a row.")
    last_checked_at = models.DateTimeField(null=True, blank=True)
    baseline_memory_mb = models.FloatField(null=True, blank=True)
    baseline_preemptions = models.FloatField(null=True, blank=True)
    # At least 6 minutes: 0 (or less) once restarted the server on every supervision tick.
    restart_after_hours = models.FloatField(
        null=True,
        blank=True,
        validators=[MinValueValidator(0.1), MaxValueValidator(24 * 366)],
        help_text="Planned restart after this many hours up, 0.1 to 8784 (blank: never).",
    )
    restart_max_preemptions = models.PositiveIntegerField(
        null=True,
        blank=True,
        validators=[MinValueValidator(1)],
        help_text="Planned restart after this many preemptions, at least 1 (blank: never).",
    )
    restart_max_memory_growth = models.FloatField(
        null=True,
        blank=True,
        validators=[MinValueValidator(0.01), MaxValueValidator(100)],
        help_text="Planned restart when memory grows by this fraction, e.g. 0.2 (blank: never).",
    )

    # The lease (who may act on the process now) is LeasedJob's: portal/core/jobs, docs/jobs.md.

    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]
        constraints = [
            models.CheckConstraint(
                condition=models.Q(concurrency_cap__isnull=True) | models.Q(concurrency_cap__gte=1),
                name="deployment_concurrency_cap_at_least_1",
                violation_error_message="The concurrency cap must be at least 1 (blank for none).",
            ),
            # The same bounds as the fields' validators, for writes that skip them (services, shells).
            models.CheckConstraint(
                condition=models.Q(restart_after_hours__isnull=True)
                | models.Q(restart_after_hours__gte=0.1, restart_after_hours__lte=24 * 366),
                name="deployment_restart_after_hours_bounded",
                violation_error_message="restart_after_hours must be 0.1 to 8784 hours (blank: never).",
            ),
            models.CheckConstraint(
                condition=models.Q(restart_max_preemptions__isnull=True)
                | models.Q(restart_max_preemptions__gte=1),
                name="deployment_restart_max_preemptions_at_least_1",
                violation_error_message="restart_max_preemptions must be at least 1 (blank: never).",
            ),
            models.CheckConstraint(
                condition=models.Q(restart_max_memory_growth__isnull=True)
                | models.Q(restart_max_memory_growth__gte=0.01, restart_max_memory_growth__lte=100),
                name="deployment_restart_max_memory_growth_bounded",
                violation_error_message="restart_max_memory_growth must be 0.01 to 100 (blank: never).",
            ),
            models.CheckConstraint(
                condition=models.Q(sla_p95_ttft_s__gt=0, sla_p95_ttft_s__lte=600)
                & models.Q(sla_p95_tpot_s__gt=0, sla_p95_tpot_s__lte=60),
                name="deployment_sla_bounded",
                violation_error_message="The SLA must be more than 0 and at most 600 s (TTFT) / 60 s (TPOT).",
            ),
        ]

    def __str__(self) -> str:
        return self.name

    # get_absolute_url: the deployment's page is observability's (settings.ABSOLUTE_URL_OVERRIDES).
    if TYPE_CHECKING:

        def get_absolute_url(self) -> str: ...

    @property
    def placed_node(self) -> Node:
        """Its node, where only a deployment the portal places can be (an adopted server has none)."""
        if self.node is None:
            raise ValueError(f"deployment {self.name} has no node")
        return self.node

    @property
    def placed_profile(self) -> DeploymentProfile:
        """Its profile, where only a deployment the portal starts can be (an adopted server has none)."""
        if self.profile is None:
            raise ValueError(f"deployment {self.name} has no profile")
        return self.profile

    @property
    def effective_engine(self) -> str:
        """The profile's engine, else the node's ("external" for an adopted server)."""
        if self.adopted:
            return "external"
        return (self.profile.engine if self.profile else "") or (self.node.engine if self.node else "vllm")

    @property
    def context_len(self) -> int | None:
        """Prompt plus output tokens one request may hold here (vLLM's max_model_len)."""
        version = self.model_version
        return served_context_len(
            profile_max_model_len=self.profile.max_model_len if self.profile else None,
            max_position_embeddings=version.max_position_embeddings,
            external=version.external,
        )

    @property
    def gpu_count(self) -> int:
        return len(self.gpu_indices)

    @property
    def command_line(self) -> str:
        import shlex

        return shlex.join(self.command) if self.command else ""


class EventStatus(models.TextChoices):
    STARTED = "started", "started"
    OK = "ok", "ok"
    FAILED = "failed", "failed"
    SKIPPED = "skipped", "skipped"
    INFO = "info", "info"


class DeploymentEvent(models.Model):
    """One step of a deployment's life, written as it happens (the page's timeline)."""

    deployment = models.ForeignKey(Deployment, on_delete=models.CASCADE, related_name="events")
    at = models.DateTimeField(auto_now_add=True, db_index=True)
    step = models.CharField(max_length=40)
    status = models.CharField(max_length=10, choices=EventStatus.choices, default=EventStatus.INFO)
    message = models.TextField(blank=True)
    seconds = models.FloatField(null=True, blank=True, help_text="How long the step took.")

    class Meta:
        ordering = ["at", "id"]

    def __str__(self) -> str:
        return f"{self.deployment_id} {self.step} {self.status}"


class MetricsSample(models.Model):
    """One supervision scrape of a serving deployment: health, /metrics and memory."""

    deployment = models.ForeignKey(Deployment, on_delete=models.CASCADE, related_name="samples")
    at = models.DateTimeField(auto_now_add=True)
    healthy = models.BooleanField()
    running = models.FloatField(null=True, blank=True)
    waiting = models.FloatField(null=True, blank=True)
    kv_cache_usage = models.FloatField(null=True, blank=True, help_text="Fraction 0..1.")
    preemptions = models.FloatField(null=True, blank=True)
    prompt_tokens = models.FloatField(null=True, blank=True)
    generation_tokens = models.FloatField(null=True, blank=True)
    requests_finished = models.FloatField(null=True, blank=True)
    memory_mb = models.FloatField(null=True, blank=True, help_text="Resident memory of the process group.")

    class Meta:
        ordering = ["at", "id"]
        indexes = [models.Index(fields=["deployment", "at"], name="sample_deployment_at")]

    def __str__(self) -> str:
        return f"{self.deployment_id} @ {self.at:%Y-%m-%d %H:%M:%S}"


class AdoptedEndpoint(Deployment):
    """Adopted servers, as the admin lists and registers them (same table as deployments)."""

    class Meta:
        proxy = True
        verbose_name = "adopted endpoint"
