"""How long one engine step takes on the simulated GPUs.

A step runs one forward pass over every token the scheduler picked (decode
tokens of running requests plus prefill chunks). Its time is the roofline of the
TP group, max(FLOPs ÷ effective compute, bytes ÷ effective bandwidth), plus the
tensor-parallel all-reduces, plus the engine's per-step overhead (kernel launches,
larger in eager mode, and the CPU work of scheduling and streaming each sequence).

Every efficiency factor below is a named constant with where its value came from.
None is fitted per concurrency level: they scale with what drives them (layers,
TP size and link, tokens and sequences in the step, eager vs CUDA graphs).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from inference.hardware import GpuSpec
from inference.modelspec import DTYPE_BYTES, ModelArch
from inference.planner import EFFECTIVE_BANDWIDTH_FRACTION, ProfileSettings, Sizing, peak_tflops

# --- memory -----------------------------------------------------------------
# FIELD_NOTES: "~900 GB/s per GPU; 75–85 % reachable" and its reference arithmetic
# uses 750 of 900 GB/s; the planner's constant, so both halves of the planner agree.
BANDWIDTH_EFFICIENCY = EFFECTIVE_BANDWIDTH_FRACTION

# --- compute ----------------------------------------------------------------
# Fraction of the tensor-core peak the matmuls of a forward pass reach: cuBLAS fp16
# GEMMs of TP8's per-GPU shapes (4096 × 512…2752) on V100 run at ~60 % of peak. Checked
# against FIELD_NOTES' "real prefill takes 3–4× the ideal": with the all-reduces and
# overheads below, a 1000-token 7B TP8 prefill step comes out ~2.6× the ideal 13.5 ms,
# a little under that range. At 0.4 it would hit 3.4×, but then the table's throughput
# at 64-256 users (where prefill is most of the GPU's work) falls ~30 % short: the two
# FIELD_NOTES figures pull apart, and 0.6 is the value a V100's GEMMs actually reach.
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
# ~1 µs). FIELD_NOTES: "TP across 8 GPUs costs ~10–15 % of a decode step for a 7B model";
# with 1 µs per hop plus the per-call launch below, a 7B TP8 decode step at batch 16
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

# --- per-step overhead -----------------------------------------------------------
# Eager mode launches every kernel of every layer from Python; ~10 of a decoder layer's
# ~15–20 kernels (norms, rotary, adds, cache writes) are shorter on the GPU than their
# ~6 µs launch, so the GPU waits ~60 µs per layer. FIELD_NOTES: "--enforce-eager ...
# costs ~15–20 % throughput where graphs would have worked": 60 µs per layer is ~20 %
# of a 7B TP8 decode step at batch 16 here (checked in tests/sim/test_costs.py).
EAGER_LAUNCH_S_PER_LAYER = 60e-6
# CUDA graphs replay a whole decode pass with one launch; what is left per layer is
# small. Mixed prefill/decode steps are still run eagerly (vLLM V0 captures graphs
# for decode batches only).
GRAPH_LAUNCH_S_PER_LAYER = 5e-6
# Host work per step that does not depend on the batch and that the GPU waits for: the
# scheduler, building and broadcasting the input tensors to the TP workers, the sampler.
# The second published V100 reference (V100-SXM2-16GB, vLLM 0.8.5, V0 engine, eager,
# fp16: ~435 tok/s per GPU for a 0.5B model at TP1) bounds it: that model's roofline step
# is ~1.5 ms, so its throughput is mostly overhead; docs/simulator.md shows what this
# model predicts for that reference's three set-ups with 1.5 ms here.
STEP_OVERHEAD_S = 1.5e-3
# Host work per scheduled sequence and step: detokenizing and streaming its token and
# updating its state. vLLM overlaps it with the next step's GPU work (async output
# processing since 0.6; the V1 engine's separate frontend process), so it only costs
# time when it outlasts the GPU step. Same source as STEP_OVERHEAD_S.
SEQUENCE_OVERHEAD_S = 10e-6


@dataclass(frozen=True)
class StepTime:
    """The parts of one step's time, in seconds."""

    compute_s: float
    memory_s: float
    communication_s: float
    overhead_s: float  # host time the GPU waits for: scheduling, eager kernel launches
    host_overlapped_s: float = 0.0  # per-sequence host work hidden behind the GPU when shorter

    @property
    def gpu_s(self) -> float:
        return max(self.compute_s, self.memory_s) + self.communication_s

    @property
    def total_s(self) -> float:
        return max(self.gpu_s, self.host_overlapped_s) + self.overhead_s


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

    @classmethod
    def of(cls, chunks: Iterable[ScheduledChunk]) -> BatchShape:
        tokens = sequences = samples = kv_tokens = 0
        pairs = 0.0
        decode_only = True
        for chunk in chunks:
            n, ctx = chunk.new_tokens, chunk.context_tokens
            tokens += n
            sequences += 1
            samples += chunk.samples
            # Causal attention: token i of the chunk attends to ctx + i + 1 keys.
            pairs += n * ctx + n * (n + 1) / 2
            kv_tokens += ctx + n
            decode_only = decode_only and n == 1
        return cls(tokens, sequences, samples, pairs, kv_tokens, decode_only)


class StepCostModel:
    """Step times for one model × profile on a TP group of one GPU type."""

    def __init__(
        self, model: ModelArch, profile: ProfileSettings, gpu: GpuSpec, *, nvlink: bool | None = None
    ) -> None:
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
        )
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
        flops = (
            self.linear_flops_per_token * batch.tokens
            + self.lm_head_flops_per_sample * batch.samples
            + self.attention_flops_per_pair * batch.attention_pairs
        )
        # Each step streams the weight shard once and every scheduled request's KV once.
        memory_bytes = self.weights_bytes_per_gpu + batch.kv_tokens * self.kv_bytes_per_token_per_gpu
        communication = (
            ALLREDUCES_PER_LAYER
            * self.layers
            * self.allreduce_s(batch.tokens * self.activation_bytes_per_token)
        )
        graphs = not self.enforce_eager and batch.decode_only
        launch = GRAPH_LAUNCH_S_PER_LAYER if graphs else EAGER_LAUNCH_S_PER_LAYER
        return StepTime(
            compute_s=flops / self.effective_flops,
            memory_s=memory_bytes / self.effective_bandwidth,
            communication_s=communication,
            overhead_s=STEP_OVERHEAD_S + launch * self.layers,
            host_overlapped_s=SEQUENCE_OVERHEAD_S * batch.sequences,
        )
