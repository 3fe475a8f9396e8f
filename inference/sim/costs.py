"""How long one engine step takes on the simulated GPUs.

A step runs one forward pass over every token the scheduler picked (decode
tokens of running requests plus prefill chunks). The GPU's part is the roofline of
the TP group, max(FLOPs ÷ effective compute, bytes ÷ effective bandwidth), plus the
tensor-parallel all-reduces, plus the gaps it idles between small kernels. The
host's part overlaps it: the CPU launching kernels (much larger in eager mode) and
the API server streaming tokens cost time only when they outlast the GPU's part.
The per-step scheduling is added to both. The host constants (`HostCosts`) are
what a calibration fits for a node (`inference.sim.calibration`).

Every efficiency factor below is a named constant with where its value came from.
None is fitted per concurrency level: they scale with what drives them (layers,
TP size and link, tokens and sequences in the step, eager vs CUDA graphs).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from inference.errors import InputError
from inference.hardware import GpuSpec
from inference.modelspec import DTYPE_BYTES, ModelArch
from inference.planner import EFFECTIVE_BANDWIDTH_FRACTION, Sizing, peak_tflops

# --- memory -----------------------------------------------------------------
from inference.profile import ProfileSettings

# docs/v100-field-guide.md#hardware: "~900 GB/s per GPU; 75–85 % reachable", and its
# reference arithmetic uses 750 of 900 GB/s; the planner's constant, so both halves of
# the planner agree.
BANDWIDTH_EFFICIENCY = EFFECTIVE_BANDWIDTH_FRACTION

# --- compute ----------------------------------------------------------------
# Fraction of the tensor-core peak the matmuls of a forward pass reach: cuBLAS fp16
# GEMMs of TP8's per-GPU shapes (4096 × 512…2752) on V100 run at ~60 % of peak. Checked
# against docs/v100-field-guide.md#hardware ("real prefill takes 3–4× the ideal"): with the
# all-reduces and
# overheads below, a 1000-token 7B TP8 prefill step comes out ~2.6× the ideal 13.5 ms,
# a little under that range. At 0.4 it would hit 3.4×, but then the table's throughput
# at 64-256 users (where prefill is most of the GPU's work) falls ~30 % short: the two
# figures of the field guide pull apart, and 0.6 is the value a V100's GEMMs actually reach.
MATMUL_EFFICIENCY = 0.6
# FLOPs per (query token, key token) pair per layer and attention head dimension:
# 2 for Q·Kᵀ and 2 for the weighted sum over V.
ATTENTION_FLOPS_PER_PAIR_PER_DIM = 4

# --- tensor-parallel communication -----------------------------------------------
# Megatron-style TP all-reduces the hidden state twice per layer (after attention
# and after the MLP). A ring all-reduce takes 2·(TP−1) hops, each paying a latency,
# and moves 2·(TP−1)/TP of the message over each GPU's link.
ALLREDUCES_PER_LAYER = 2
# Per-hop latency of NCCL's low-latency protocol between V100s (NVLink's own latency is
# ~1 µs). docs/v100-field-guide.md#hardware: "TP across 8 GPUs costs ~10–15 % of a decode
# step for a 7B model"; with 1 µs per hop plus the per-call launch below, a 7B TP8 decode
# step at batch 16
# spends ~14 % of its time in all-reduce (checked in tests/sim/test_costs.py).
NVLINK_HOP_LATENCY_S = 1e-6
# Over PCIe the hops cross the CPU root complex (nvidia-smi topo: PHB/NODE/SYS): several
# times NVLink's latency; 8 µs is the order NCCL-tests show for small PCIe all-reduces.
PCIE_HOP_LATENCY_S = 8e-6
# Each eager-mode NCCL call costs a host-side launch before any hop starts.
ALLREDUCE_LAUNCH_S = 5e-6
# Share of the link's datasheet bandwidth a ring all-reduce reaches as bus bandwidth:
# NCCL-tests report ~130 GB/s on a DGX-1 (8 × V100 SXM2, 300 GB/s NVLink); PCIe 3.0
# x16 (16 GB/s) gives ~10–12 GB/s once traffic crosses the CPU.
NVLINK_BUS_EFFICIENCY = 130 / 300
PCIE_BUS_EFFICIENCY = 0.7

# --- host-side costs (the calibrated ones) ---------------------------------------------
# The four constants below are what `inference.sim.calibration` fits from measured levels
# of a node (`HostCosts`); their values here are the uncalibrated defaults. They belong to
# the node's CPU and its vLLM version, not to one model: they are counted per step, per
# layer and per streamed token, so a calibration made with one model carries to another.
#
# How they combine (docs/simulator.md, "Host costs and how they overlap"): kernel launches
# are asynchronous, so the CPU's work for a step (launching its kernels, plus the per-token
# work of the requests in it) runs while the GPU executes what was already launched. A step
# costs the larger of the CPU's work and the GPU's work (its roofline plus the gaps it idles
# between small kernels), not their sum, plus the per-step scheduling that neither overlaps.
#
# CPU time to launch one decoder layer's kernels in eager mode (PyTorch dispatch of
# ~15-20 kernels). The default makes the CPU never the bottleneck of a V100 step, which is
# what the eager V100 figures of docs/v100-field-guide.md#reference-run show; a slow host
# CPU in front of a fast GPU is where
# it dominates: an H200 behind a 16-core VM took ~22 ms per 7B decode step eager against
# ~4.5 ms with CUDA graphs (vLLM 0.26), ~0.6 ms per layer.
EAGER_LAUNCH_S_PER_LAYER = 60e-6
# The same with CUDA graphs: one replay per pass (or per piece between attention calls).
GRAPH_LAUNCH_S_PER_LAYER = 5e-6
# Host work per step that does not depend on the batch and that the GPU waits for: the
# scheduler, building and broadcasting the input tensors to the TP workers, the sampler.
# The second published V100 reference (V100-SXM2-16GB, vLLM 0.8.5, V0 engine, eager,
# fp16: ~435 tok/s per GPU for a 0.5B model at TP1) bounds it: that model's roofline step
# is ~1.5 ms, so its throughput is mostly overhead; docs/simulator.md shows what this
# model predicts for that reference's three set-ups with 1.5 ms here.
STEP_OVERHEAD_S = 1.5e-3
# Host work per streamed token: the engine's per-request bookkeeping and output, the API
# server's detokenizing and SSE chunk. It overlaps the GPU (async output processing since
# vLLM 0.6; V1's separate frontend process) but shares the CPU with the launches: on the
# H200 VM an eager step grew ~60-190 µs per extra sequence while the GPU's work did not,
# which only launch work plus per-token work explains. It costs time only when the CPU's
# part outlasts the GPU's.
API_S_PER_TOKEN = 10e-6
# The API server's work per request, outside the engine's steps: parsing and validating the
# request, the chat template, tokenizing the prompt, handing it to the engine process, and
# the first token's detokenizing and SSE chunk. It delays the request's arrival at the
# scheduler (so it adds to TTFT and E2EL, and in a closed loop to the time between a user's
# requests) without taking a step's time. Default 0: before calibration, TTFT is the
# engine's alone, as it always was; a node's calibration fits it from the measured TTFT
# (on the H200 VM of tests/sim/data/h200, ~10-20 ms).
API_S_PER_REQUEST = 0.0
# The part of the API server's per-request work that its one process does for one request at a
# time (issue 40): the front end is a single asyncio process, so the chat template, tokenizing and
# handing a request to the engine are served in turn. Requests that arrive together (the closed
# loop's start, and users whose equal-length requests end in the same step) queue for it, so TTFT
# grows with the load even with an idle engine. On the H200 VM TTFT grew ~2-3 ms per user from 1 to
# 64 users on a fixed 128-token workload whose prefill is a millisecond or two
# (tests/sim/data/h200-layers). Default 0: uncalibrated TTFT is the engine's alone, as before.
API_SERIAL_S_PER_REQUEST = 0.0
# How much more GPU time the prefill work of a step takes than the model's compute estimate
# (FLOPs ÷ peak × MATMUL_EFFICIENCY), per mode: a step carrying a prompt chunk runs attention
# over thousands of keys, unfused elementwise kernels over every prompt token (eager mode
# has no torch.compile fusion), and sizes no CUDA graph was captured for. A calibration fits
# it from TTFT and the throughput of loaded levels; 1 (the default) is the compute estimate,
# which is every prediction made before calibration.
EAGER_PREFILL_FACTOR = 1.0
GRAPH_PREFILL_FACTOR = 1.0
# The low-load host effect in eager mode (docs/simulator.md, "The low-load host effect"):
# a decode step carrying one sequence took longer on the H200 VMs than the launch work a
# step of 16 showed, with inter-token gaps alternating between ~19 and ~29 ms at one user.
# Charged per step, in full at one sequence and fading linearly to nothing at
# LOW_BATCH_SEQUENCES; the default 0 leaves every step as it was. Kept so that a calibration
# saved with it predicts as before; fits since issue 40 set the per-layer form below instead.
EAGER_LOW_BATCH_S_PER_STEP = 0.0
# The same effect charged per layer, on the CPU beside the launches (issue 40): on one VM the
# eager decode step was layers × 0.72 ms (±0.06) plus 1.1 ms (±1.8) whatever the shape and the
# load (20 levels of 8-48-layer 7B/14B engines, tests/sim/data/h200-layers), so a slower host at
# small batches is a slower launch of every layer, not a per-step constant: fitted per step on a
# 32-layer model, it put an 8-layer cut of the same model +97 % over at one user.
EAGER_LOW_BATCH_S_PER_LAYER = 0.0
# Where the low-load effect is gone: the 7B runs show it at 1 user and not at 16, the 14B
# at 8 users and not at 32.
LOW_BATCH_SEQUENCES = 16

# --- GPU-side launch gaps (fixed) -----------------------------------------------------
# Even when the CPU launches ahead of the GPU, ~10 of a decoder layer's ~15-20 kernels
# (norms, rotary, adds, cache writes) are shorter on the GPU than their ~6 µs launch, so
# the GPU idles ~60 µs per layer in eager mode. docs/v100-field-guide.md#hardware:
# "--enforce-eager ... costs ~15-20 % throughput where graphs would have worked": 60 µs
# per layer is ~20 % of a 7B
# TP8 decode step at batch 16 here (checked in tests/sim/test_costs.py). Mixed
# prefill/decode steps keep these gaps with CUDA graphs too (vLLM V0 captured decode
# batches only; V1's piecewise graphs still run attention between the pieces).
EAGER_GAP_S_PER_LAYER = 60e-6
# A CUDA-graph replay of a decode pass leaves little idle time per layer.
GRAPH_GAP_S_PER_LAYER = 5e-6


@dataclass(frozen=True)
class HostCosts:
    """The host-side constants of one node and vLLM version (defaults: uncalibrated).

    `as_dict()` is the `"calibration"` object of `manage.py simulate --json`, and
    `from_dict` reads it back (missing names keep their defaults). Names ending in `_s...`
    are seconds; the `_factor`s are plain ratios.
    """

    step_overhead_s: float = STEP_OVERHEAD_S
    eager_launch_s_per_layer: float = EAGER_LAUNCH_S_PER_LAYER
    graph_launch_s_per_layer: float = GRAPH_LAUNCH_S_PER_LAYER
    api_s_per_token: float = API_S_PER_TOKEN
    # Added with issue 24 (TTFT and the low-load effect). A calibration saved before them
    # lacks these names and loads with their defaults, which change nothing it predicted.
    api_s_per_request: float = API_S_PER_REQUEST
    eager_prefill_factor: float = EAGER_PREFILL_FACTOR
    graph_prefill_factor: float = GRAPH_PREFILL_FACTOR
    eager_low_batch_s_per_step: float = EAGER_LOW_BATCH_S_PER_STEP
    # Added with issue 40; see EAGER_LOW_BATCH_S_PER_LAYER and API_SERIAL_S_PER_REQUEST.
    eager_low_batch_s_per_layer: float = EAGER_LOW_BATCH_S_PER_LAYER
    api_serial_s_per_request: float = API_SERIAL_S_PER_REQUEST

    def as_dict(self) -> dict[str, float]:
        return {name: getattr(self, name) for name in HOST_COST_BOUNDS}

    @classmethod
    def from_dict(cls, values: object) -> HostCosts:
        """A calibration object as JSON holds it; InputError("calibration") names what is wrong."""
        if not isinstance(values, dict):
            raise InputError("calibration", f"must be an object of {{name: seconds}}, got {values!r}")
        unknown = sorted(str(name) for name in values if name not in HOST_COST_BOUNDS)
        if unknown:
            raise InputError(
                "calibration", f"unknown names {', '.join(unknown)}; known: {', '.join(HOST_COST_BOUNDS)}"
            )
        checked: dict[str, float] = {}
        for name, value in values.items():
            low, high = HOST_COST_BOUNDS[name]
            unit = "" if is_factor(name) else " s"
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                what = "a number" if is_factor(name) else "a number of seconds"
                raise InputError("calibration", f"{name} must be {what}, got {value!r}")
            if not low <= value <= high:
                raise InputError(
                    "calibration", f"{name} must be between {low:g} and {high:g}{unit}, got {value!r}"
                )
            checked[name] = float(value)
        return cls(**checked)


# What a calibration may set each constant to, in seconds. The upper ends are far above
# anything seen (a 0.6 ms eager layer on a slow VM, 1-2 ms of scheduling per step) and keep
# a fit from wandering into a model where one host cost explains everything.
HOST_COST_BOUNDS: dict[str, tuple[float, float]] = {
    "step_overhead_s": (0.0, 50e-3),
    "eager_launch_s_per_layer": (0.0, 5e-3),
    "graph_launch_s_per_layer": (0.0, 1e-3),
    "api_s_per_token": (0.0, 1e-3),
    "api_s_per_request": (0.0, 1.0),
    # Ratios, not seconds: prefill at a quarter of the compute estimate's time up to 10 times it.
    "eager_prefill_factor": (0.25, 10.0),
    "graph_prefill_factor": (0.25, 10.0),
    "eager_low_batch_s_per_step": (0.0, 50e-3),
    "eager_low_batch_s_per_layer": (0.0, 2e-3),
    "api_serial_s_per_request": (0.0, 0.1),
}


def is_factor(name: str) -> bool:
    """Whether a calibration constant is a ratio rather than seconds."""
    return name.endswith("_factor")


def describe_calibration(values: dict[str, float]) -> str:
    """`name 12.3 µs, …, name ×1.20`: a calibration for people to read."""
    return ", ".join(
        f"{name} ×{value:.3g}" if is_factor(name) else f"{name} {value * 1e6:.1f} µs"
        for name, value in values.items()
        if isinstance(value, int | float)  # not the "basis" a calibration carries since issue 40
    )

DEFAULT_HOST_COSTS = HostCosts()


@dataclass(frozen=True)
class StepTime:
    """The parts of one step's time, in seconds."""

    compute_s: float
    memory_s: float
    communication_s: float
    overhead_s: float  # per-step scheduling: host time nothing overlaps
    host_overlapped_s: float = 0.0  # launches + per-token work: hidden behind the GPU when shorter
    launch_gap_s: float = 0.0  # time the GPU idles between small kernels even when launched ahead

    @property
    def gpu_s(self) -> float:
        return max(self.compute_s, self.memory_s) + self.communication_s

    @property
    def total_s(self) -> float:
        return max(self.gpu_s + self.launch_gap_s, self.host_overlapped_s) + self.overhead_s

    @property
    def output_lag_s(self) -> float:
        """How long after the step its sampled tokens reach the API server.

        vLLM's engine launches the next step before it reads this one's sampled tokens back
        (async scheduling), so they are handed on once the CPU has launched the next step,
        taken to be like this one. Where the CPU bounds the step (eager mode on a slow host,
        at small batches) that is the whole of the next step's launch work; where the GPU's
        part outlasts the CPU's, the CPU starts the next launch that much earlier, and with
        CUDA graphs (launch work ≪ GPU work) nothing is lost.
        """
        cpu, gpu = self.host_overlapped_s, self.gpu_s + self.launch_gap_s
        return cpu if cpu >= gpu else max(0.0, 2 * cpu - gpu)


@dataclass(frozen=True)
class ScheduledChunk:
    """One request's share of a step: `new_tokens` computed after `context_tokens` already cached."""

    context_tokens: int
    new_tokens: int
    samples: bool  # whether the step ends with a sampled token for this request


@dataclass(frozen=True)
class BatchShape:
    """A step's totals: what the cost of a forward pass depends on."""

    tokens: int  # new tokens computed (prefill chunks + one per decode)
    sequences: int  # requests in the step
    samples: int  # requests that sample a token at the end of the step
    attention_pairs: float  # (query, key) pairs over the step's causal attention
    kv_tokens: int  # cached + new tokens whose KV the step reads
    decode_only: bool
    prefill_tokens: int = 0  # of `tokens`, those in prompt chunks (more than one new token)
    prefill_attention_pairs: float = 0.0  # of `attention_pairs`, those of prompt chunks

    @classmethod
    def of(cls, chunks: Iterable[ScheduledChunk]) -> BatchShape:
        tokens = sequences = samples = kv_tokens = prefill_tokens = 0
        pairs = prefill_pairs = 0.0
        decode_only = True
        for chunk in chunks:
            n, ctx = chunk.new_tokens, chunk.context_tokens
            tokens += n
            sequences += 1
            samples += chunk.samples
            # Causal attention: token i of the chunk attends to ctx + i + 1 keys.
            chunk_pairs = n * ctx + n * (n + 1) / 2
            pairs += chunk_pairs
            kv_tokens += ctx + n
            decode_only = decode_only and n == 1
            if n > 1:
                prefill_tokens += n
                prefill_pairs += chunk_pairs
        return cls(tokens, sequences, samples, pairs, kv_tokens, decode_only, prefill_tokens, prefill_pairs)


class StepCostModel:
    """Step times for one model × profile on a TP group of one GPU type."""

    def __init__(
        self,
        model: ModelArch,
        profile: ProfileSettings,
        gpu: GpuSpec,
        *,
        nvlink: bool | None = None,
        host: HostCosts = DEFAULT_HOST_COSTS,
        attention_slowdown: float = 1.0,
    ) -> None:
        """`attention_slowdown`: the factor on attention's FLOPs and KV-cache reads for the node's
        attention path (inference.engines.attention_slowdown: a V1 line on Volta)."""
        self.host = host
        sizing = Sizing(model, profile, gpu)
        tp = profile.tensor_parallel_size
        self.tp = tp
        self.layers = model.num_layers
        self.enforce_eager = profile.enforce_eager
        dtype = sizing.serving_dtype
        self.weights_bytes_per_gpu = sizing.weights_bytes_per_gpu
        self.kv_bytes_per_token_per_gpu = sizing.kv_bytes_per_token_per_gpu
        # Linear layers run for every token; the LM head only for rows that sample.
        self.linear_flops_per_token = 2 * model.linear_params / tp
        self.lm_head_flops_per_sample = 2 * model.vocab_size * model.hidden_size / tp
        heads_per_gpu = model.num_attention_heads / tp
        self.attention_flops_per_pair = (
            ATTENTION_FLOPS_PER_PAIR_PER_DIM * model.num_layers * heads_per_gpu * model.head_dim
        ) * attention_slowdown
        # Decode attention reads each scheduled request's KV once; a slower path reads it as slowly.
        self.kv_read_bytes_per_token_per_gpu = sizing.kv_bytes_per_token_per_gpu * attention_slowdown
        self.effective_flops = peak_tflops(gpu, dtype) * 1e12 * MATMUL_EFFICIENCY
        self.effective_bandwidth = gpu.bandwidth_gb_s * 1e9 * BANDWIDTH_EFFICIENCY
        self.activation_bytes_per_token = model.hidden_size * DTYPE_BYTES[dtype]
        if nvlink is None:
            nvlink = gpu.nvlink_gb_s is not None
        if nvlink and gpu.nvlink_gb_s:
            self.hop_latency_s = NVLINK_HOP_LATENCY_S
            self.bus_bandwidth = gpu.nvlink_gb_s * 1e9 * NVLINK_BUS_EFFICIENCY
        else:
            self.hop_latency_s = PCIE_HOP_LATENCY_S
            self.bus_bandwidth = gpu.pcie_gb_s * 1e9 * PCIE_BUS_EFFICIENCY

    def allreduce_s(self, message_bytes: float) -> float:
        if self.tp == 1:
            return 0.0
        hops = 2 * (self.tp - 1)
        return (
            ALLREDUCE_LAUNCH_S
            + hops * self.hop_latency_s
            + hops / self.tp * message_bytes / self.bus_bandwidth
        )

    def step_time(self, chunks: Iterable[ScheduledChunk]) -> StepTime:
        return self.batch_time(BatchShape.of(chunks))

    def batch_time(self, batch: BatchShape) -> StepTime:
        if batch.tokens == 0:
            return StepTime(0.0, 0.0, 0.0, 0.0, 0.0)
        host = self.host
        flops = (
            self.linear_flops_per_token * batch.tokens
            + self.lm_head_flops_per_sample * batch.samples
            + self.attention_flops_per_pair * batch.attention_pairs
        )
        prefill_factor = host.eager_prefill_factor if self.enforce_eager else host.graph_prefill_factor
        if prefill_factor != 1.0 and batch.prefill_tokens:
            # The prompt chunks' share of the work runs at the node's measured prefill rate.
            prefill_flops = (
                self.linear_flops_per_token * batch.prefill_tokens
                + self.attention_flops_per_pair * batch.prefill_attention_pairs
            )
            flops += (prefill_factor - 1.0) * prefill_flops
        # Each step streams the weight shard once and every scheduled request's KV once.
        memory_bytes = self.weights_bytes_per_gpu + batch.kv_tokens * self.kv_read_bytes_per_token_per_gpu
        communication = (
            ALLREDUCES_PER_LAYER
            * self.layers
            * self.allreduce_s(batch.tokens * self.activation_bytes_per_token)
        )
        launch = host.eager_launch_s_per_layer if self.enforce_eager else host.graph_launch_s_per_layer
        gap = GRAPH_GAP_S_PER_LAYER if not self.enforce_eager and batch.decode_only else EAGER_GAP_S_PER_LAYER
        overhead = host.step_overhead_s
        if self.enforce_eager and batch.sequences < LOW_BATCH_SEQUENCES:
            fade = (LOW_BATCH_SEQUENCES - batch.sequences) / (LOW_BATCH_SEQUENCES - 1)
            overhead += host.eager_low_batch_s_per_step * fade
            # The per-layer form slows the launch itself, so it overlaps the GPU like the launch.
            launch += host.eager_low_batch_s_per_layer * fade
        return StepTime(
            compute_s=flops / self.effective_flops,
            memory_s=memory_bytes / self.effective_bandwidth,
            communication_s=communication,
            overhead_s=overhead,
            host_overlapped_s=launch * self.layers + host.api_s_per_token * batch.samples,
            launch_gap_s=gap * self.layers,
        )
