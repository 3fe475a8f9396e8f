"""Model versions: architecture facts from config.json, storage, and release hashes."""

from __future__ import annotations

from django.conf import settings
from django.core.validators import MinValueValidator, RegexValidator
from django.db import models
from django.urls import reverse

from inference.modelspec import ModelArch
from portal.core.jobs.models import LeasedJob

# Served model names keep the dots of upstream names (llama-3.1-70b) but no
# slashes, so they can sit in a URL path segment.
model_name_validator = RegexValidator(
    r"^[A-Za-z0-9][A-Za-z0-9._-]*$", "Use letters, digits, dots, dashes and underscores."
)


class WeightDtype(models.TextChoices):
    FLOAT16 = "float16", "float16"
    BFLOAT16 = "bfloat16", "bfloat16"
    FLOAT32 = "float32", "float32"


class Quantization(models.TextChoices):
    NONE = "", "none"
    GPTQ = "gptq", "GPTQ"
    AWQ = "awq", "AWQ"
    FP8 = "fp8", "FP8"
    BITSANDBYTES = "bitsandbytes", "bitsandbytes"
    COMPRESSED_TENSORS = "compressed-tensors", "compressed-tensors"


def _positive() -> list:
    return [MinValueValidator(1)]


class ModelVersion(models.Model):
    name = models.CharField(
        max_length=100,
        unique=True,
        validators=[model_name_validator],
        help_text="Served model name: what clients put in `model`.",
    )
    source = models.CharField(max_length=255, blank=True, help_text="Where it came from, e.g. a hub repo id.")
    revision = models.CharField(max_length=100, blank=True, help_text="Upstream revision or release tag.")
    path = models.CharField(max_length=500, blank=True, help_text="Directory of the weights on the nodes.")

    # Architecture facts, read from config.json (see inference.hf_config).
    model_type = models.CharField(max_length=50)
    num_layers = models.PositiveIntegerField(validators=_positive())
    hidden_size = models.PositiveIntegerField(validators=_positive())
    num_attention_heads = models.PositiveIntegerField(validators=_positive())
    num_kv_heads = models.PositiveIntegerField(validators=_positive())
    head_dim = models.PositiveIntegerField(validators=_positive())
    intermediate_size = models.PositiveIntegerField(validators=_positive())
    vocab_size = models.PositiveIntegerField(validators=_positive())
    tie_word_embeddings = models.BooleanField(default=False)
    attention_bias = models.BooleanField(default=False)
    max_position_embeddings = models.PositiveIntegerField(validators=_positive())
    param_count = models.BigIntegerField(editable=False, help_text="Derived from the architecture facts.")
    weight_dtype = models.CharField(max_length=10, choices=WeightDtype.choices, default=WeightDtype.FLOAT16)
    quantization = models.CharField(max_length=30, choices=Quantization.choices, blank=True, default="")
    quant_bits = models.PositiveSmallIntegerField(null=True, blank=True)
    quant_group_size = models.PositiveIntegerField(null=True, blank=True)
    config = models.JSONField(default=dict, blank=True, help_text="The config.json it was read from.")

    # Release hashes (docs/v100-field-guide.md#operating-habits: a tokenizer updated without its weights
    # garbled output for weeks, so both are pinned at release).
    weights_sha256 = models.CharField(max_length=64, blank=True)
    tokenizer_sha256 = models.CharField(max_length=64, blank=True)
    weight_files = models.JSONField(default=dict, blank=True, help_text="Relative path → SHA-256.")
    tokenizer_files = models.JSONField(default=dict, blank=True, help_text="Relative path → SHA-256.")
    hashed_at = models.DateTimeField(null=True, blank=True)
    # The last Hash files job (the node's agent): queued, its progress, done, or why it stopped.
    hash_status = models.CharField(max_length=300, blank=True)
    hash_status_at = models.DateTimeField(null=True, blank=True)
    # A version with no files to hash (the simulator reads only its config.json) may be marked
    # release-checked by staff: it may then be started and rolled out on simulated nodes only.
    simulated_release_at = models.DateTimeField(
        null=True,
        blank=True,
        help_text="Marked release-checked for simulated nodes only (no files, no release hashes).",
    )

    external = models.BooleanField(
        default=False,
        help_text="Recorded from a running server's /v1/models (register_endpoint): only its name and "
        "max model length are known, so the planner cannot plan it.",
    )
    callable_by_name = models.BooleanField(
        default=True,
        help_text="Clients may call it by its own name. Off: only through a served model name (a rollout's "
        "versions that clients should not pin).",
    )
    smoke_expected_substring = models.CharField(
        max_length=200, blank=True, help_text="A smoke-test reply must contain this (blank: any sane reply)."
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    def save(self, *args, **kwargs) -> None:
        self.param_count = self.arch().param_count
        super().save(*args, **kwargs)

    def get_absolute_url(self) -> str:
        return reverse("registry:model-detail", args=[self.name])

    def arch(self) -> ModelArch:
        return ModelArch(
            model_type=self.model_type,
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            intermediate_size=self.intermediate_size,
            vocab_size=self.vocab_size,
            tie_word_embeddings=self.tie_word_embeddings,
            max_position_embeddings=self.max_position_embeddings,
            weight_dtype=self.weight_dtype,
            quantization=self.quantization or None,
            quant_bits=self.quant_bits,
            quant_group_size=self.quant_group_size,
            attention_bias=self.attention_bias,
        )

    @property
    def params_billions(self) -> float:
        return self.param_count / 1e9

    @property
    def params_display(self) -> str:
        """ "6.74 B", "1.10 B", or "4.6 M" for a tiny test model (whose billions round to 0.00)."""
        if self.external:
            return "unknown (external)"
        if self.param_count >= 100_000_000:
            return f"{self.param_count / 1e9:.2f} B"
        return f"{self.param_count / 1e6:.1f} M"


class ConversionState(models.TextChoices):
    QUEUED = "queued", "queued"
    RUNNING = "running", "running"
    SUCCEEDED = "succeeded", "succeeded"
    FAILED = "failed", "failed"


ACTIVE_CONVERSION_STATES = (ConversionState.QUEUED, ConversionState.RUNNING)


class ConversionJob(LeasedJob):
    """A bf16 → fp16 copy of a model version, run by the agent of the node holding its files.

    The new model version exists only once the job succeeded: the output is
    written to a hidden directory beside `output_path` and renamed into place
    in the transaction that registers it (inference.convert; services).
    It runs under a lease (LeasedJob: portal/core/jobs, docs/jobs.md): `lease_token` fences
    whoever runs it, `attempt` counts the claims; `lease_expires_at` is renewed with each
    progress write, so a job whose worker died shows as interrupted and may be superseded.
    """

    source = models.ForeignKey(ModelVersion, on_delete=models.CASCADE, related_name="conversions")
    result = models.ForeignKey(
        ModelVersion, on_delete=models.SET_NULL, null=True, blank=True, related_name="converted_by"
    )
    node = models.ForeignKey(
        "inventory.Node",
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="conversion_jobs",
        help_text="The node whose agent runs it (where the files are); blank: `manage.py convert_bf16`.",
    )
    new_name = models.CharField(max_length=100, validators=[model_name_validator])
    output_path = models.CharField(max_length=500, help_text="Directory the fp16 copy is renamed to.")
    clamp = models.BooleanField(
        default=False, help_text="Set values beyond ±65504 to ±65504 instead of stopping."
    )
    requested_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, blank=True, related_name="+"
    )

    state = models.CharField(max_length=10, choices=ConversionState.choices, default=ConversionState.QUEUED)
    phase = models.CharField(max_length=20, blank=True, help_text="converting, registering")
    attempt = models.PositiveIntegerField(default=0)
    tensors_done = models.PositiveIntegerField(default=0)
    tensors_total = models.PositiveIntegerField(default=0)
    bytes_done = models.BigIntegerField(default=0)
    bytes_total = models.BigIntegerField(default=0)
    current_file = models.CharField(max_length=500, blank=True)
    overflow_total = models.BigIntegerField(default=0, help_text="Finite values with |x| > 65504.")
    overflows = models.JSONField(
        default=list, blank=True, help_text="Per tensor: file, tensor, count, max |x|."
    )
    nonfinite_total = models.BigIntegerField(default=0, help_text="NaN/inf values, kept as they are.")
    underflow_total = models.BigIntegerField(default=0, help_text="Nonzero values that became zero.")
    report = models.JSONField(default=dict, blank=True)
    error = models.TextField(blank=True)

    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    updated_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        constraints = [
            # One conversion at a time per output directory and per new name: the claim
            # that keeps two jobs from writing the same target.
            models.UniqueConstraint(
                fields=["output_path"],
                condition=models.Q(state__in=["queued", "running"]),
                name="conversion_one_active_per_output",
            ),
            models.UniqueConstraint(
                fields=["new_name"],
                condition=models.Q(state__in=["queued", "running"]),
                name="conversion_one_active_per_name",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.source.name} → {self.new_name} ({self.state})"

    def get_absolute_url(self) -> str:
        return reverse("registry:conversion-detail", args=[self.source.name, self.pk])

    @property
    def is_active(self) -> bool:
        return self.state in ACTIVE_CONVERSION_STATES

    @property
    def is_stale(self) -> bool:
        """Running, but its worker stopped renewing the lease (killed, or the node is down)."""
        from django.utils import timezone

        return (
            self.state == ConversionState.RUNNING
            and self.lease_expires_at is not None
            and self.lease_expires_at < timezone.now()
        )

    @property
    def is_unclaimed(self) -> bool:
        """Queued for longer than a lease: the node's agent is not consuming its queue."""
        from django.utils import timezone

        return (
            self.state == ConversionState.QUEUED
            and self.lease_expires_at is not None
            and self.lease_expires_at < timezone.now()
        )

    @property
    def percent(self) -> float:
        if self.state == ConversionState.SUCCEEDED:
            return 100.0
        return 100.0 * self.bytes_done / self.bytes_total if self.bytes_total else 0.0


SHARE_TOTAL_BP = 10_000  # a served model's shares add up to 100 % in basis points (0.01 %)


class ServedModel(models.Model):
    """A stable name clients call (`chat-7b`) that points at one or more model versions, each with a
    share of its traffic (docs/decisions.md, "Served model names and traffic shares"). A version's own
    name stays callable. A rollout (portal.rollouts) moves the shares; ops may set them by hand."""

    name = models.CharField(
        max_length=100,
        unique=True,
        validators=[model_name_validator],
        help_text="The stable name clients put in `model`; never a model version's name.",
    )
    description = models.CharField(max_length=200, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class ServedModelVersion(models.Model):
    """One version behind a served model and its share of the traffic, in basis points."""

    served_model = models.ForeignKey(ServedModel, on_delete=models.CASCADE, related_name="versions")
    model_version = models.ForeignKey(ModelVersion, on_delete=models.PROTECT, related_name="served_as")
    share_bp = models.PositiveIntegerField(help_text="Share of the traffic in basis points (10000 = 100 %).")

    class Meta:
        ordering = ["served_model", "-share_bp", "model_version__name"]
        constraints = [
            models.UniqueConstraint(fields=["served_model", "model_version"], name="served_version_once"),
            models.CheckConstraint(
                condition=models.Q(share_bp__lte=SHARE_TOTAL_BP),
                name="served_version_share_bounded",
                violation_error_message="A share is at most 100 %.",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.served_model_id}:{self.model_version_id} {self.share_bp / 100:g} %"

    @property
    def share_percent(self) -> float:
        return self.share_bp / 100
