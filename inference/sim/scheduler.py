"""vLLM's scheduling, simulated: continuous batching over a paged KV cache.

One `Scheduler.schedule()` call is one engine step, as in vLLM's V1 scheduler:
requests already running go first (a decode token each, or the next chunk of a
prompt), each growing its KV blocks; when blocks run out the most recently
admitted running request is preempted (its blocks freed, to be recomputed later)
and goes back to the front of the queue. Then, if nothing was preempted, waiting
requests are admitted first-come first-served while there are free sequence
slots, token budget and KV blocks; a prompt's cached prefix blocks are reused.
Without chunked prefill a prompt that does not fit the step's remaining budget
waits for a later step; with it, the prompt is cut to the budget.

`finish_step()` applies the step: computed tokens advance, a request whose
tokens are all computed samples one, and finished requests free their blocks.
The same code drives the real-time server and the virtual-clock sweep.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from inference.sim.costs import BatchShape, ScheduledChunk
from inference.sim.kv_cache import KVCache, block_hashes


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass(eq=False)
class SimRequest:
    """One generation request as the engine tracks it."""

    request_id: str
    prompt_token_ids: Sequence[int] | None  # None: give num_prompt_tokens and block_hashes instead
    max_tokens: int  # output tokens at most
    stop_after: int | None = None  # output tokens after which the "model" emits EOS; None: never
    arrival_time: float = 0.0
    status: Status = Status.WAITING
    num_output_tokens: int = 0
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache on first admission
    finish_reason: str | None = None
    blocks: list[int] = field(default_factory=list)
    num_prompt_tokens: int = 0  # set from prompt_token_ids when they are given
    num_tokens: int = 0  # tokens whose KV the request needs: the prompt plus every sampled token
    num_published_blocks: int = 0  # leading blocks whose hashes are in the prefix cache
    block_hashes: list[int] | None = None  # of the prompt's full blocks; computed when None
    context: object = None  # the driver's own data (a stream queue, a benchmark record)

    def __post_init__(self) -> None:
        if self.prompt_token_ids is not None:
            self.num_prompt_tokens = len(self.prompt_token_ids)
        self.num_tokens = self.num_prompt_tokens + self.num_output_tokens

    @property
    def finished(self) -> bool:
        return self.status in (Status.FINISHED, Status.ABORTED)

    def hashes(self, block_size: int) -> list[int]:
        if self.block_hashes is None:
            self.block_hashes = block_hashes(self.prompt_token_ids or (), block_size)
        return self.block_hashes


@dataclass
class StepPlan:
    """What one step computes: per request, how many new tokens after how many cached."""

    scheduled: list[tuple[SimRequest, int]]
    preempted: list[SimRequest]

    def chunks(self) -> list[ScheduledChunk]:
        return [
            ScheduledChunk(
                context_tokens=request.num_computed_tokens,
                new_tokens=n,
                samples=request.num_computed_tokens + n >= request.num_tokens,
            )
            for request, n in self.scheduled
        ]

    def batch(self) -> BatchShape:
        """The step's totals, which is all the cost model needs (cheaper than `chunks`)."""
        tokens = samples = kv_tokens = prefill_tokens = 0
        pairs = prefill_pairs = 0.0
        for request, n in self.scheduled:
            context = request.num_computed_tokens
            tokens += n
            kv_tokens += context + n
            if n == 1:
                pairs += context + 1
            else:
                chunk_pairs = n * context + n * (n + 1) / 2
                pairs += chunk_pairs
                prefill_tokens += n
                prefill_pairs += chunk_pairs
            if context + n >= request.num_tokens:
                samples += 1
        return BatchShape(
            tokens=tokens,
            sequences=len(self.scheduled),
            samples=samples,
            attention_pairs=pairs,
            kv_tokens=kv_tokens,
            decode_only=prefill_tokens == 0,
            prefill_tokens=prefill_tokens,
            prefill_attention_pairs=prefill_pairs,
        )

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


@dataclass
class StepOutcome:
    """What a step produced: requests that sampled a token, and those that finished."""

    sampled: list[SimRequest]
    finished: list[SimRequest]
    prompt_tokens: int  # prompts completed this step (vLLM's prompt_tokens counter)


class Scheduler:
    def __init__(
        self,
        *,
        kv_cache: KVCache,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        enable_chunked_prefill: bool,
    ) -> None:
        self.kv = kv_cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.num_preemptions = 0

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: SimRequest) -> None:
        self.waiting.append(request)

    def abort(self, request: SimRequest) -> None:
        if request.finished:
            return
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv.release(request.blocks)
        request.status = Status.ABORTED
        request.finish_reason = "abort"

    def _preempt(self, request: SimRequest) -> None:
        # Recompute, not swap: vLLM V1 frees the blocks and prefills prompt + output again.
        self.kv.release(request.blocks)
        request.num_published_blocks = 0
        request.status = Status.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def schedule(self) -> StepPlan:
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[SimRequest, int]] = []
        preempted: list[SimRequest] = []

        running = self.running
        block_size = self.kv.block_size
        add = scheduled.append
        index = 0
        while index < len(running) and budget > 0:
            request = running[index]
            computed = request.num_computed_tokens
            new = request.num_tokens - computed
            if new > budget:
                new = budget
            if new <= 0:
                index += 1
                continue
            target = computed + new
            if -(-target // block_size) <= len(request.blocks):
                # Room in the last block: nothing to allocate (most decode steps).
                add((request, new))
                budget -= new
                index += 1
                continue
            while not self.kv.can_allocate(len(request.blocks), (), target):
                victim = running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            if request.status is not Status.RUNNING:
                break
            self.kv.allocate(request.blocks, (), target)
            add((request, new))
            budget -= new
            index += 1

        # vLLM admits nobody in a step that had to preempt: the cache is full.
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            hashes = request.hashes(self.kv.block_size)
            computed_blocks = self.kv.computed_blocks(hashes, request.num_tokens)
            cached = len(computed_blocks) * self.kv.block_size
            new = request.num_tokens - cached
            if new > budget:
                if not self.enable_chunked_prefill:
                    break
                new = budget
            if not self.kv.can_allocate(0, computed_blocks, cached + new):
                break
            self.waiting.popleft()
            self.kv.allocate(request.blocks, computed_blocks, cached + new)
            if request.num_preemptions == 0:
                request.num_cached_tokens = cached
            self.kv.record_prefix_lookup(request.num_tokens, cached)
            request.num_computed_tokens = cached
            request.status = Status.RUNNING
            self.running.append(request)
            scheduled.append((request, new))
            budget -= new
        return StepPlan(scheduled=scheduled, preempted=preempted)

    def finish_step(self, plan: StepPlan) -> StepOutcome:
        sampled: list[SimRequest] = []
        finished: list[SimRequest] = []
        prompt_tokens = 0
        block_size = self.kv.block_size
        caching = self.kv.enable_prefix_caching
        max_model_len = self.max_model_len
        running = Status.RUNNING
        for request, new in plan.scheduled:
            if request.status is not running:
                continue  # aborted while the step ran
            computed = request.num_computed_tokens + new
            request.num_computed_tokens = computed
            prompt = request.num_prompt_tokens
            if caching and request.num_published_blocks < prompt // block_size:
                request.num_published_blocks = self.kv.cache_full_blocks(
                    request.blocks,
                    request.hashes(block_size),
                    min(computed, prompt),
                    request.num_published_blocks,
                )
            if computed < request.num_tokens:
                continue  # a prompt chunk; the prompt is not complete yet
            outputs = request.num_output_tokens = request.num_output_tokens + 1
            request.num_tokens += 1
            if outputs == 1:
                # vLLM counts a request's prompt once, when its prefill produces a token.
                prompt_tokens += prompt
            sampled.append(request)
            if request.stop_after is not None and outputs >= request.stop_after:
                reason = "stop"
            elif outputs >= request.max_tokens or request.num_tokens >= max_model_len:
                reason = "length"
            else:
                continue
            request.status = Status.FINISHED
            request.finish_reason = reason
            finished.append(request)
        if finished:
            done = set(map(id, finished))
            self.running = [r for r in self.running if id(r) not in done]
            for request in finished:
                self.kv.release(request.blocks)
        return StepOutcome(sampled=sampled, finished=finished, prompt_tokens=prompt_tokens)
