"""GPU nodes and their GPUs, entered by hand or discovered from nvidia-smi."""

from __future__ import annotations

from django.core.validators import MinValueValidator, RegexValidator
from django.db import models
from django.urls import reverse

from inference.hardware import GpuSpec, get_gpu
from portal.celery import node_queue

# Node names become Celery queue names (`node.<name>`) and URL parts.
node_name_validator = RegexValidator(
    r"^[a-z0-9][a-z0-9-]{0,62}$", "Use lowercase letters, digits and dashes (like a hostname)."
)


class Interconnect(models.TextChoices):
    NVLINK = "nvlink", "NVLink"
    PCIE = "pcie", "PCIe only"
    NONE = "none", "Single GPU / none"


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
    software_python = models.CharField(max_length=500, blank=True, help_text="The Python probed.")
    software_probed_at = models.DateTimeField(null=True, blank=True)
    software_error = models.TextField(blank=True, help_text="Why the last probe failed.")
    topology_text = models.TextField(blank=True, help_text="Last `nvidia-smi topo -m` output.")
    discovered_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    def get_absolute_url(self) -> str:
        return reverse("inventory:node-detail", args=[self.name])

    @property
    def queue(self) -> str:
        return node_queue(self.name)

    @property
    def is_cpu_only(self) -> bool:
        return not self.gpus.exists()


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

    class Meta:
        ordering = ["node", "index"]
        constraints = [models.UniqueConstraint(fields=["node", "index"], name="gpu_unique_index_per_node")]

    def __str__(self) -> str:
        return f"{self.node.name}:{self.index} {self.name}"

    def spec(self) -> GpuSpec:
        """The planner's view of this GPU: the catalog entry with this row's measured facts."""
        from dataclasses import replace

        base = get_gpu(self.catalog_key) if self.catalog_key else None
        facts = {
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
