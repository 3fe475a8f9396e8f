"""The GPUs the portal knows: datasheet figures and the names nvidia-smi prints.

The planner reads memory, bandwidth and tensor-core peaks from here; node
discovery maps what `nvidia-smi --query-gpu=name,memory.total` reports on a node
to a catalog entry with `match_gpu`; forms and APIs look GPUs up with `get_gpu`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from inference.errors import InputError


@dataclass(frozen=True)
class GpuSpec:
    """Datasheet facts of one GPU model.

    Throughputs are peaks: decimal GB/s for memory and links (per direction for
    PCIe), dense tensor-core TFLOPS (no 2:4 sparsity) for fp16/bf16.
    """

    key: str
    display_name: str
    memory_gib: float
    bandwidth_gb_s: float
    fp16_tflops: float
    bf16_tflops: float | None
    compute_capability: str
    form_factor: str  # "sxm" | "pcie"
    nvlink_gb_s: float | None
    pcie_gb_s: float
    nvidia_smi_names: tuple[str, ...]
    # Plain (non-tensor-core) fp32 peak: what a float32 deployment gets, since
    # PyTorch leaves TF32 matmuls off by default. None when not known.
    fp32_tflops: float | None = None
    # The board's default power limit (what nvidia-smi's power.limit starts at) and the NVLink
    # links of the GPU (how they are wired is the node's topology); None where not catalogued.
    power_limit_w: float | None = None
    nvlink_links: int | None = None
    source: str = ""  # the datasheet (or NVIDIA tool) the row's figures come from

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * 2**30)

    @property
    def cc_tuple(self) -> tuple[int, int]:
        major, minor = self.compute_capability.split(".")
        return int(major), int(minor)

    @property
    def sm_arch(self) -> str:
        major, minor = self.cc_tuple
        return f"sm_{major}{minor}"

    @property
    def supports_bf16(self) -> bool:
        # bf16 tensor cores arrived with Ampere (8.0); vLLM refuses bf16 below it.
        return self.cc_tuple >= (8, 0)

    @property
    def is_volta(self) -> bool:
        # Volta is 7.0 (V100) and 7.2 (Xavier); 7.5 is already Turing (T4).
        return (7, 0) <= self.cc_tuple < (7, 5)


# Sources of the V100 rows (NVIDIA's own documents):
_V100_DATASHEET = "NVIDIA Tesla V100 datasheet (2018): SXM2 300 W, PCIe 250 W, NVLink 2.0 300 GB/s"
_VOLTA_WHITEPAPER = "NVIDIA Volta architecture whitepaper: six NVLink 2.0 links per GV100"
_DGX2_DATASHEET = "NVIDIA DGX-2 datasheet: 16x V100 32 GB (SXM3) on NVSwitch, 2 PFLOPS, 350 W per GPU"
_DGX_STATION_DATASHEET = (
    "NVIDIA DGX Station datasheet: 4x V100 (DGXS) fully NVLink-connected; nvidia-smi shows 300 W caps"
)
_DCGM_LS = "NVIDIA DCGM diag defaults for Tesla V100-SXM2-32GB-LS (PG503 SKU 203): 250 W power target"


def _v100(
    key: str,
    memory_gib: float,
    board: str,
    smi_name: str,
    *,
    power_limit_w: float,
    source: str,
    fp16_tflops: float | None = None,
) -> GpuSpec:
    # NVIDIA Tesla V100 datasheet (2018): 900 GB/s HBM2; tensor peak 125 TFLOPS
    # (SXM2, 300 W) or 112 (PCIe, 250 W); fp32 15.7 / 14; NVLink 2.0 300 GB/s on
    # SXM2; PCIe 3.0 x16 is ~16 GB/s per direction.
    sxm = board != "PCIe"
    return GpuSpec(
        key=key,
        display_name=f"NVIDIA V100 {board} {memory_gib:g} GB",
        memory_gib=memory_gib,
        bandwidth_gb_s=900,
        fp16_tflops=fp16_tflops or (125 if sxm else 112),
        bf16_tflops=None,
        compute_capability="7.0",
        form_factor="sxm" if sxm else "pcie",
        nvlink_gb_s=300 if sxm else None,
        pcie_gb_s=16,
        nvidia_smi_names=(smi_name,),
        fp32_tflops=15.7 if sxm else 14,
        power_limit_w=power_limit_w,
        nvlink_links=6 if sxm else 0,
        source=source if not sxm else f"{source}; {_VOLTA_WHITEPAPER}",
    )


_CATALOG: tuple[GpuSpec, ...] = (
    _v100("v100-sxm2-16gb", 16, "SXM2", "Tesla V100-SXM2-16GB", power_limit_w=300, source=_V100_DATASHEET),
    _v100("v100-sxm2-32gb", 32, "SXM2", "Tesla V100-SXM2-32GB", power_limit_w=300, source=_V100_DATASHEET),
    # The lower-clocked SXM2 board of the DGX-1 "Max-Q"; no public datasheet gives its peak, so the
    # SXM2 peak stands (an upper bound), and its 250 W target is DCGM's.
    _v100("v100-sxm2-32gb-ls", 32, "SXM2 LS", "Tesla V100-SXM2-32GB-LS", power_limit_w=250, source=_DCGM_LS),
    # DGX-2's board: 2 PFLOPS over 16 GPUs is 125 TFLOPS each, at 350 W.
    _v100("v100-sxm3-32gb", 32, "SXM3", "Tesla V100-SXM3-32GB", power_limit_w=350, source=_DGX2_DATASHEET),
    _v100(
        "v100-dgxs-16gb", 16, "DGXS", "Tesla V100-DGXS-16GB", power_limit_w=300, source=_DGX_STATION_DATASHEET
    ),
    _v100(
        "v100-dgxs-32gb", 32, "DGXS", "Tesla V100-DGXS-32GB", power_limit_w=300, source=_DGX_STATION_DATASHEET
    ),
    _v100("v100-pcie-16gb", 16, "PCIe", "Tesla V100-PCIE-16GB", power_limit_w=250, source=_V100_DATASHEET),
    _v100("v100-pcie-32gb", 32, "PCIe", "Tesla V100-PCIE-32GB", power_limit_w=250, source=_V100_DATASHEET),
    # NVIDIA V100S PCIe datasheet: faster HBM2 (1134 GB/s) and clocks (130 TFLOPS).
    GpuSpec(
        key="v100s-pcie-32gb",
        display_name="NVIDIA V100S PCIe 32 GB",
        memory_gib=32,
        bandwidth_gb_s=1134,
        fp16_tflops=130,
        bf16_tflops=None,
        compute_capability="7.0",
        form_factor="pcie",
        nvlink_gb_s=None,
        pcie_gb_s=16,
        nvidia_smi_names=("Tesla V100S-PCIE-32GB",),
        fp32_tflops=16.4,
        power_limit_w=250,
        nvlink_links=0,
        source="NVIDIA V100S PCIe datasheet: 1134 GB/s, 130 TFLOPS, 250 W",
    ),
    # NVIDIA T4 datasheet: 320 GB/s GDDR6, 65 TFLOPS mixed precision, PCIe 3.0.
    GpuSpec(
        key="t4",
        display_name="NVIDIA T4",
        memory_gib=16,
        bandwidth_gb_s=320,
        fp16_tflops=65,
        bf16_tflops=None,
        compute_capability="7.5",
        form_factor="pcie",
        nvlink_gb_s=None,
        pcie_gb_s=16,
        nvidia_smi_names=("Tesla T4",),
        fp32_tflops=8.1,
    ),
    # NVIDIA A10 datasheet: 600 GB/s GDDR6, 125 TFLOPS fp16/bf16 dense, PCIe 4.0.
    GpuSpec(
        key="a10",
        display_name="NVIDIA A10",
        memory_gib=24,
        bandwidth_gb_s=600,
        fp16_tflops=125,
        bf16_tflops=125,
        compute_capability="8.6",
        form_factor="pcie",
        nvlink_gb_s=None,
        pcie_gb_s=32,
        nvidia_smi_names=("NVIDIA A10",),
        fp32_tflops=31.2,
    ),
    # NVIDIA L40S datasheet: 864 GB/s GDDR6, 362 TFLOPS fp16/bf16 dense, PCIe 4.0.
    GpuSpec(
        key="l40s",
        display_name="NVIDIA L40S",
        memory_gib=48,
        bandwidth_gb_s=864,
        fp16_tflops=362,
        bf16_tflops=362,
        compute_capability="8.9",
        form_factor="pcie",
        nvlink_gb_s=None,
        pcie_gb_s=32,
        nvidia_smi_names=("NVIDIA L40S",),
        fp32_tflops=91.6,
    ),
    # NVIDIA A100 datasheet: 312 TFLOPS fp16/bf16 dense; 1555 GB/s (40 GB), 2039
    # GB/s (80 GB SXM4), 1935 GB/s (80 GB PCIe); NVLink 3 600 GB/s on SXM4.
    GpuSpec(
        key="a100-sxm4-40gb",
        display_name="NVIDIA A100 SXM4 40 GB",
        memory_gib=40,
        bandwidth_gb_s=1555,
        fp16_tflops=312,
        bf16_tflops=312,
        compute_capability="8.0",
        form_factor="sxm",
        nvlink_gb_s=600,
        pcie_gb_s=32,
        nvidia_smi_names=("NVIDIA A100-SXM4-40GB",),
        fp32_tflops=19.5,
    ),
    GpuSpec(
        key="a100-sxm4-80gb",
        display_name="NVIDIA A100 SXM4 80 GB",
        memory_gib=80,
        bandwidth_gb_s=2039,
        fp16_tflops=312,
        bf16_tflops=312,
        compute_capability="8.0",
        form_factor="sxm",
        nvlink_gb_s=600,
        pcie_gb_s=32,
        nvidia_smi_names=("NVIDIA A100-SXM4-80GB",),
        fp32_tflops=19.5,
    ),
    GpuSpec(
        key="a100-pcie-40gb",
        display_name="NVIDIA A100 PCIe 40 GB",
        memory_gib=40,
        bandwidth_gb_s=1555,
        fp16_tflops=312,
        bf16_tflops=312,
        compute_capability="8.0",
        form_factor="pcie",
        nvlink_gb_s=None,
        pcie_gb_s=32,
        nvidia_smi_names=("NVIDIA A100-PCIE-40GB",),
        fp32_tflops=19.5,
    ),
    GpuSpec(
        key="a100-pcie-80gb",
        display_name="NVIDIA A100 PCIe 80 GB",
        memory_gib=80,
        bandwidth_gb_s=1935,
        fp16_tflops=312,
        bf16_tflops=312,
        compute_capability="8.0",
        form_factor="pcie",
        nvlink_gb_s=None,
        pcie_gb_s=32,
        nvidia_smi_names=("NVIDIA A100 80GB PCIe",),
        fp32_tflops=19.5,
    ),
    # NVIDIA H100 datasheet: SXM5 3350 GB/s HBM3, 989 TFLOPS fp16/bf16 dense,
    # NVLink 4 900 GB/s; PCIe 2000 GB/s HBM2e, 756 TFLOPS. PCIe 5.0 x16 ~64 GB/s.
    GpuSpec(
        key="h100-sxm5-80gb",
        display_name="NVIDIA H100 SXM5 80 GB",
        memory_gib=80,
        bandwidth_gb_s=3350,
        fp16_tflops=989,
        bf16_tflops=989,
        compute_capability="9.0",
        form_factor="sxm",
        nvlink_gb_s=900,
        pcie_gb_s=64,
        nvidia_smi_names=("NVIDIA H100 80GB HBM3",),
        fp32_tflops=67,
    ),
    GpuSpec(
        key="h100-pcie-80gb",
        display_name="NVIDIA H100 PCIe 80 GB",
        memory_gib=80,
        bandwidth_gb_s=2000,
        fp16_tflops=756,
        bf16_tflops=756,
        compute_capability="9.0",
        form_factor="pcie",
        nvlink_gb_s=None,
        pcie_gb_s=64,
        nvidia_smi_names=("NVIDIA H100 PCIe",),
        fp32_tflops=51,
    ),
    # NVIDIA H200 datasheet: 141 GB HBM3e at 4800 GB/s, same compute as H100 SXM.
    GpuSpec(
        key="h200-sxm-141gb",
        display_name="NVIDIA H200 SXM 141 GB",
        memory_gib=141,
        bandwidth_gb_s=4800,
        fp16_tflops=989,
        bf16_tflops=989,
        compute_capability="9.0",
        form_factor="sxm",
        nvlink_gb_s=900,
        pcie_gb_s=64,
        nvidia_smi_names=("NVIDIA H200",),
        fp32_tflops=67,
    ),
)

GPU_CATALOG: dict[str, GpuSpec] = {spec.key: spec for spec in _CATALOG}

# Drivers have prefixed the same board with "Tesla " (V100, T4) or "NVIDIA "
# (A100 onwards), and some older drivers print no prefix at all.
_VENDOR_PREFIX = re.compile(r"^(NVIDIA|TESLA)\s+")

# Families for names that carry no exact catalog spelling (other drivers, other
# board variants): a pattern over the normalised name and the candidate keys,
# first match wins, so the more specific pattern comes first. Memory then picks
# the variant (16 vs 32 GB).
_FAMILIES: tuple[tuple[re.Pattern[str], tuple[str, ...]], ...] = (
    (re.compile(r"V100S"), ("v100s-pcie-32gb",)),
    (re.compile(r"V100.*SXM3"), ("v100-sxm3-32gb",)),
    (re.compile(r"V100.*DGXS"), ("v100-dgxs-16gb", "v100-dgxs-32gb")),
    (re.compile(r"V100.*SXM2?.*-LS\b"), ("v100-sxm2-32gb-ls",)),
    (re.compile(r"V100.*SXM"), ("v100-sxm2-16gb", "v100-sxm2-32gb")),
    (re.compile(r"V100"), ("v100-pcie-16gb", "v100-pcie-32gb")),
    (re.compile(r"A100.*SXM"), ("a100-sxm4-40gb", "a100-sxm4-80gb")),
    (re.compile(r"A100"), ("a100-pcie-40gb", "a100-pcie-80gb")),
    (re.compile(r"H100.*NVL"), ()),  # 94 GB, not in the catalog: unknown, not an 80 GB H100
    (re.compile(r"H100.*PCIE"), ("h100-pcie-80gb",)),
    (re.compile(r"H100"), ("h100-sxm5-80gb",)),
    (re.compile(r"H200"), ("h200-sxm-141gb",)),
    (re.compile(r"\bL40S\b"), ("l40s",)),
    (re.compile(r"\bA10\b"), ("a10",)),
    (re.compile(r"\bT4\b"), ("t4",)),
)

# nvidia-smi reports less than the nominal size (ECC, reserved memory): a T4
# shows 15360 MiB of 16 GiB, an L40S 46068 MiB of 48 GiB (~6 % short). 12 %
# accepts those and still rejects a different board (H100 NVL, 94 GB, is not an
# 80 GB H100).
_MEMORY_TOLERANCE = 0.12


def _normalise(name: str) -> str:
    return _VENDOR_PREFIX.sub("", " ".join(name.upper().split()))


def _exact(name: str) -> GpuSpec | None:
    wanted = _normalise(name)
    for spec in _CATALOG:
        spellings = {spec.key.upper(), *(_normalise(smi) for smi in spec.nvidia_smi_names)}
        if wanted in spellings:
            return spec
    return None


def get_gpu(name: str) -> GpuSpec:
    """The catalog entry for a key or an nvidia-smi name, case-insensitive."""
    spec = _exact(name)
    if spec is None:
        raise InputError("gpu", f"unknown GPU {name!r}; known: {', '.join(GPU_CATALOG)}")
    return spec


def _memory_matches(spec: GpuSpec, memory_mib: int) -> bool:
    nominal_mib = spec.memory_gib * 1024
    return abs(memory_mib - nominal_mib) <= _MEMORY_TOLERANCE * nominal_mib


def match_gpu(smi_name: str, memory_mib: int | None = None) -> GpuSpec | None:
    """The catalog entry for what nvidia-smi printed on a node, or None if unknown.

    `memory_mib` is nvidia-smi's `memory.total`; it picks the variant when the
    name does not say it, and rules out a board whose memory contradicts it.
    """
    spec = _exact(smi_name)
    if spec is not None:
        return spec
    normalised = _normalise(smi_name)
    keys = next((keys for pattern, keys in _FAMILIES if pattern.search(normalised)), ())
    candidates = [GPU_CATALOG[key] for key in keys]
    size = re.search(r"(\d+)\s*GB", normalised)
    if size:
        candidates = [c for c in candidates if c.memory_gib == int(size.group(1))]
    if memory_mib is not None:
        candidates = [c for c in candidates if _memory_matches(c, memory_mib)]
    # Two variants left means the name did not say which and memory was not given.
    return candidates[0] if len(candidates) == 1 else None
