"""GPU nodes and their GPUs, entered by hand or discovered from nvidia-smi."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from django.conf import settings
from django.core.validators import MinValueValidator, RegexValidator
from django.db import models
from django.utils import timezone

from inference.hardware import GpuSpec, get_gpu
from portal.celery import node_queue
from portal.core.jobs.models import LeasedJob

# Node names become Celery queue names (`node.<name>`) and URL parts.
node_name_validator = RegexValidator(
    r"^[a-z0-9][a-z0-9-]{0,62}$", "Use lowercase letters, digits and dashes (like a hostname)."
)


class Interconnect(models.TextChoices):
    NVLINK = "nvlink", "NVLink"
    PCIE = "pcie", "PCIe only"
    NONE = "none", "Single GPU / none"


class AgentState(models.TextChoices):
    LISTENING = "listening", "listening"
    SILENT = "silent", "not heard from"
    NEVER = "never", "never seen"


@dataclass(frozen=True)
class AgentHeartbeat:
    """What the portal knows of a node's agent from its heartbeats (inventory.agent_heartbeat)."""

    state: AgentState
    seen_at: datetime | None
    age_s: float | None
    versions: dict[str, Any]

    @property
    def listening(self) -> bool:
        return self.state == AgentState.LISTENING


class Node(models.Model):
    name = models.CharField(max_length=63, unique=True, validators=[node_name_validator])
    hostname = models.CharField(max_length=255, blank=True, help_text="How the portal reaches the node.")
    description = models.CharField(max_length=255, blank=True)
    interconnect = models.CharField(max_length=10, choices=Interconnect.choices, default=Interconnect.NONE)
    vllm_python = models.CharField(
        max_length=500,
        blank=True,
        help_text="Python of the node's vLLM virtual environment (e.g. /opt/vllm/.venv/bin/python).",
    )
    engine = models.CharField(
        max_length=10,
        choices=[("vllm", "vLLM"), ("sim", "simulator (inference.sim)")],
        default="vllm",
        help_text="Default engine of deployments here (a profile may override it).",
    )
    driver_version = models.CharField(max_length=50, blank=True)
    # The vLLM environment as the agent's probe found it (inference.env_probe).
    vllm_version = models.CharField(max_length=50, blank=True)
    torch_version = models.CharField(max_length=50, blank=True)
    torch_cuda_version = models.CharField(max_length=20, blank=True, help_text="Blank: a CPU build.")
    torch_arch_list = models.JSONField(
        default=list, blank=True, help_text="torch.cuda.get_arch_list(): the GPU kernels the build ships."
    )
    vllm_kernel_archs = models.JSONField(
        default=dict,
        blank=True,
        help_text="vLLM's compiled ops (e.g. _C.abi3.so) → the sm_XY their fatbinaries carry; empty: none.",
    )
    software_python = models.CharField(max_length=500, blank=True, help_text="The Python probed.")
    software_probed_at = models.DateTimeField(null=True, blank=True)
    software_error = models.TextField(blank=True, help_text="Why the last probe failed.")
    topology_text = models.TextField(blank=True, help_text="Last `nvidia-smi topo -m` output.")
    discovery_notes = models.JSONField(
        default=list,
        blank=True,
        help_text="What the last discovery could not read: rows, fields this driver lacks, the topology.",
    )
    discovered_at = models.DateTimeField(null=True, blank=True)
    # The agent's heartbeat (inventory.agent_heartbeat, sent to the node's queue by beat).
    agent_seen_at = models.DateTimeField(null=True, blank=True, help_text="The agent's last heartbeat.")
    agent_versions = models.JSONField(
        default=dict, blank=True, help_text="What the agent runs: portal version and commit, Python, Celery."
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    # get_absolute_url: the node's page is benchmarks' (settings.ABSOLUTE_URL_OVERRIDES).
    if TYPE_CHECKING:

        def get_absolute_url(self) -> str: ...

    @property
    def queue(self) -> str:
        return node_queue(self.name)

    @property
    def is_cpu_only(self) -> bool:
        return not self.gpus.exists()

    @property
    def agent(self) -> AgentHeartbeat:
        """Whether an agent listens on the node's queue: it answered a heartbeat within
        NODE_AGENT_SILENT_S (three heartbeat intervals unless set)."""
        if self.agent_seen_at is None:
            return AgentHeartbeat(AgentState.NEVER, None, None, {})
        age = max(0.0, (timezone.now() - self.agent_seen_at).total_seconds())
        state = AgentState.LISTENING if age <= settings.NODE_AGENT_SILENT_S else AgentState.SILENT
        return AgentHeartbeat(state, self.agent_seen_at, age, dict(self.agent_versions or {}))


class GpuHealth(models.TextChoices):
    """inference.gpu_health.HealthState: degraded and lost GPUs take no new deployment."""

    HEALTHY = "healthy", "healthy"
    WARNING = "warning", "warning"
    DEGRADED = "degraded", "degraded"
    LOST = "lost", "lost"
    UNKNOWN = "unknown", "unknown (no telemetry)"


class Gpu(models.Model):
    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="gpus")
    index = models.PositiveSmallIntegerField(help_text="nvidia-smi index, the CUDA_VISIBLE_DEVICES number.")
    name = models.CharField(max_length=100, help_text="As nvidia-smi prints it, e.g. Tesla V100-SXM2-32GB.")
    catalog_key = models.CharField(
        max_length=50, blank=True, help_text="Entry of the GPU catalog (blank for a GPU the catalog lacks)."
    )
    uuid = models.CharField(max_length=64, blank=True)
    pci_bus_id = models.CharField(max_length=32, blank=True)
    memory_mib = models.PositiveIntegerField(validators=[MinValueValidator(1)])
    compute_capability = models.CharField(
        max_length=5, validators=[RegexValidator(r"^\d{1,2}\.\d$", "Like 7.0")]
    )
    bandwidth_gb_s = models.FloatField(validators=[MinValueValidator(1)])
    fp16_tflops = models.FloatField(validators=[MinValueValidator(0.1)])
    nvlink_peers = models.JSONField(default=list, blank=True, help_text="Indices of GPUs linked by NVLink.")
    # Health, as the node agent's last telemetry sample judged it (inference/gpu_health/).
    health_state = models.CharField(max_length=10, choices=GpuHealth.choices, default=GpuHealth.UNKNOWN)
    health_findings = models.JSONField(default=list, blank=True, help_text="level, code, message of each.")
    health_checked_at = models.DateTimeField(null=True, blank=True, help_text="The last sample.")
    health_since = models.DateTimeField(null=True, blank=True, help_text="When it entered this state.")
    health_cleared_at = models.DateTimeField(
        null=True, blank=True, help_text="Marked healthy after a reset: older Xids are history."
    )
    throttled_since = models.DateTimeField(null=True, blank=True, help_text="Current throttling began.")

    class Meta:
        ordering = ["node", "index"]
        constraints = [models.UniqueConstraint(fields=["node", "index"], name="gpu_unique_index_per_node")]

    def __str__(self) -> str:
        return f"{self.node.name}:{self.index} {self.name}"

    def spec(self) -> GpuSpec:
        """The planner's view of this GPU: the catalog entry with this row's measured facts."""
        from dataclasses import replace

        base = get_gpu(self.catalog_key) if self.catalog_key else None
        facts: dict[str, Any] = {
            "memory_gib": self.memory_mib / 1024,
            "bandwidth_gb_s": self.bandwidth_gb_s,
            "fp16_tflops": self.fp16_tflops,
            "compute_capability": self.compute_capability,
        }
        if base is not None:
            return replace(base, **facts)
        return GpuSpec(
            key="custom",
            display_name=self.name,
            bf16_tflops=self.fp16_tflops if float(self.compute_capability) >= 8.0 else None,
            form_factor="pcie",
            nvlink_gb_s=None,
            pcie_gb_s=16.0,
            nvidia_smi_names=(self.name,),
            **facts,
        )


# What a node acceptance leaves behind (portal/benchmarks/acceptance/): a model version whose
# source starts with ACCEPTANCE_SOURCE_PREFIX, a profile of it, and a stopped deployment of the
# ACCEPTANCE_TEAM_SLUG team. The main lists and the planner's defaults leave them out; each list
# links to them (`?acceptance=show`).
ACCEPTANCE_TEAM_SLUG = "acceptance"
ACCEPTANCE_SOURCE_PREFIX = "node acceptance"


class GpuSample(models.Model):
    """One GPU's telemetry in one UTC minute (the last sample of the minute wins), kept
    RETENTION_GPU_SAMPLES_DAYS. `answered` False: nvidia-smi did not list it (the values are empty)."""

    gpu = models.ForeignKey(Gpu, on_delete=models.CASCADE, related_name="samples")
    minute = models.DateTimeField(help_text="Start of the UTC minute.")
    at = models.DateTimeField(help_text="When it was read.")
    answered = models.BooleanField(default=True)
    state = models.CharField(max_length=10, choices=GpuHealth.choices)
    utilization_pct = models.FloatField(null=True, blank=True)
    memory_used_mib = models.FloatField(null=True, blank=True)
    temperature_c = models.FloatField(null=True, blank=True)
    power_draw_w = models.FloatField(null=True, blank=True)
    power_limit_w = models.FloatField(null=True, blank=True)
    sm_clock_mhz = models.FloatField(null=True, blank=True)
    memory_clock_mhz = models.FloatField(null=True, blank=True)
    throttle_reasons = models.JSONField(default=list, blank=True)
    ecc_corrected_volatile = models.BigIntegerField(null=True, blank=True)
    ecc_uncorrected_volatile = models.BigIntegerField(null=True, blank=True)
    ecc_corrected_aggregate = models.BigIntegerField(null=True, blank=True)
    ecc_uncorrected_aggregate = models.BigIntegerField(null=True, blank=True)
    retired_pages_single_bit = models.IntegerField(null=True, blank=True)
    retired_pages_double_bit = models.IntegerField(null=True, blank=True)
    retired_pages_pending = models.BooleanField(null=True, blank=True)
    remapped_rows_pending = models.BooleanField(null=True, blank=True)
    remapped_rows_failure = models.BooleanField(null=True, blank=True)
    pcie_gen = models.PositiveSmallIntegerField(null=True, blank=True)
    pcie_gen_max = models.PositiveSmallIntegerField(null=True, blank=True)
    pcie_width = models.PositiveSmallIntegerField(null=True, blank=True)
    pcie_width_max = models.PositiveSmallIntegerField(null=True, blank=True)
    persistence_mode = models.BooleanField(null=True, blank=True)

    class Meta:
        ordering = ["gpu", "minute"]
        constraints = [models.UniqueConstraint(fields=["gpu", "minute"], name="gpu_sample_unique_minute")]
        indexes = [models.Index(fields=["at"], name="gpu_sample_at")]

    def __str__(self) -> str:
        return f"{self.gpu} {self.minute:%Y-%m-%d %H:%M}"


class AcceptanceState(models.TextChoices):
    RUNNING = "running", "running"
    PASSED = "passed", "passed"
    SLOW = "slow", "slower than predicted"
    FAILED = "failed", "failed"


class NodeAcceptance(LeasedJob):
    """One acceptance ("burn-in") of a node: a reference model started, benchmarked and compared
    with the simulator's prediction for the same profile and workload (portal/benchmarks/acceptance/)."""

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="acceptances")
    requested_by = models.CharField(max_length=150, blank=True, help_text="Username, or `system`.")
    state = models.CharField(max_length=10, choices=AcceptanceState.choices, default=AcceptanceState.RUNNING)
    step = models.CharField(max_length=40, blank=True, help_text="The step running now (or the last one).")
    progress = models.JSONField(
        default=list, blank=True, help_text="Every step as it happened: step, status, message, seconds."
    )
    # What was asked for.
    shape = models.CharField(max_length=100, help_text="`tiny` or a bundled config's name.")
    layers = models.PositiveIntegerField(null=True, blank=True, help_text="Blank: the shape's layers.")
    dtype = models.CharField(max_length=10, default="float16")
    enforce_eager = models.BooleanField(default=False)
    mix = models.CharField(max_length=200)
    concurrency = models.JSONField(default=list, help_text="The benchmarked levels.")
    requests_per_level = models.PositiveIntegerField(null=True, blank=True, help_text="Blank: 4 per user.")
    gpu_indices = models.JSONField(default=list, blank=True)
    predict_gpu = models.CharField(
        max_length=50, blank=True, help_text="GPU catalog key the simulator predicts for (blank: the node's)."
    )
    margin = models.FloatField(help_text="Slower than predicted by more than this fraction: `slow`.")
    # A deployment profile's name, not a key: profiles live in deployments, above this layer, and
    # the record must outlive the profile. Its launch flags as the run used them are in `profile_flags`.
    profile_name = models.CharField(
        max_length=100, blank=True, help_text="Deployment profile whose vLLM flags it ran (blank: defaults)."
    )
    profile_flags = models.JSONField(
        null=True, blank=True, help_text="The profile's launch flags the reference server ran with."
    )
    # What it found.
    deployment_name = models.CharField(max_length=100, blank=True)
    model_name = models.CharField(max_length=100, blank=True)
    levels = models.JSONField(
        default=list, blank=True, help_text="Per level: measured, predicted and calibrated figures."
    )
    measured = models.JSONField(null=True, blank=True, help_text="The bench report (`bench --json`).")
    engine_start_s = models.FloatField(null=True, blank=True, help_text="Launch → model listed.")
    calibration = models.JSONField(null=True, blank=True, help_text="The simulator's fitted constants.")
    versions = models.JSONField(default=dict, blank=True, help_text="vLLM, torch, CUDA, driver, GPU.")
    verdict = models.TextField(blank=True)
    error = models.TextField(blank=True)
    gpu_health = models.JSONField(
        default=dict, blank=True, help_text="GPU health readings at the start and the end of the run."
    )
    started_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-started_at", "-id"]
        constraints = [
            # The claim that makes "accept this node" safe to click twice: one running per node.
            models.UniqueConstraint(
                fields=["node"], condition=models.Q(state="running"), name="one_running_acceptance_per_node"
            )
        ]

    def __str__(self) -> str:
        return f"{self.node.name} acceptance {self.pk} ({self.state})"

    @property
    def finished(self) -> bool:
        return self.state != AcceptanceState.RUNNING
