"""The simulated paged KV cache: fixed-size blocks, reference counts and prefix caching.

It follows vLLM's V1 `KVCacheManager`/`BlockPool`: a request holds a list of
blocks of `block_size` token slots; a block that is full of known tokens gets a
hash chained from its predecessor's, so two requests whose prompts start with
the same tokens share those blocks. A freed block keeps its hash and goes to the
back of an LRU free queue; allocating takes from the front and evicts that hash.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

# The hash of "no previous block": the first block of every prompt chains from it.
_ROOT_HASH = 0


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """Chained hashes of the full blocks of `token_ids` (a partial last block has none)."""
    hashes: list[int] = []
    parent = _ROOT_HASH
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(token_ids[start : start + block_size])))
        hashes.append(parent)
    return hashes


class KVCache:
    """Blocks of the whole TP group (each GPU holds its shard of every block)."""

    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_count = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        # LRU order of blocks nobody references: the front is evicted first.
        self.free: OrderedDict[int, None] = OrderedDict((block, None) for block in range(num_blocks))
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.prefix_queries = 0  # tokens looked up in the prefix cache
        self.prefix_hits = 0  # of which found

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        """vLLM's `kv_cache_usage_perc`: the fraction of blocks in use (0..1)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def computed_blocks(self, hashes: Sequence[int], num_tokens: int) -> list[int]:
        """The cached blocks that start a prompt of `num_tokens` with these block hashes.

        vLLM always computes at least the last prompt token (it needs its logits),
        so a full hit stops one block short of a prompt that is a whole number of blocks.
        """
        if not self.enable_prefix_caching:
            return []
        usable = (num_tokens - 1) // self.block_size
        hits: list[int] = []
        for block_hash in hashes[:usable]:
            block = self.cached.get(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def record_prefix_lookup(self, queried_tokens: int, hit_tokens: int) -> None:
        """Count one admitted request's lookup (vLLM's prefix-cache hit rate counts these)."""
        self.prefix_queries += queried_tokens
        self.prefix_hits += hit_tokens

    def can_allocate(self, held: int, computed: Sequence[int], total_tokens: int) -> bool:
        """Whether a request holding `held` blocks can grow to `total_tokens` (reusing `computed`)."""
        new = self.blocks_needed(total_tokens) - held - len(computed)
        # A cache hit on a free block takes it out of the free queue too.
        reused_free = sum(1 for block in computed if self.ref_count[block] == 0)
        return new + reused_free <= self.num_free_blocks

    def allocate(self, blocks: list[int], computed: Sequence[int], total_tokens: int) -> None:
        """Grow `blocks` (in place) to hold `total_tokens`, first taking the `computed` hits."""
        for block in computed:
            if self.ref_count[block] == 0:
                del self.free[block]
            self.ref_count[block] += 1
            blocks.append(block)
        for _ in range(self.blocks_needed(total_tokens) - len(blocks)):
            block, _ = self.free.popitem(last=False)
            evicted = self.block_hash[block]
            if evicted is not None:
                if self.cached.get(evicted) == block:
                    del self.cached[evicted]
                self.block_hash[block] = None
            self.ref_count[block] = 1
            blocks.append(block)

    def cache_full_blocks(
        self, blocks: Sequence[int], hashes: Sequence[int], num_computed: int, already: int
    ) -> int:
        """Publish the hashes of blocks whose tokens are now all computed; returns how many
        leading blocks are published (pass it back as `already` next time)."""
        if not self.enable_prefix_caching:
            return already
        full = min(num_computed // self.block_size, len(hashes), len(blocks))
        for index in range(already, full):
            block = blocks[index]
            if self.block_hash[block] is None:
                block_hash = hashes[index]
                self.block_hash[block] = block_hash
                self.cached.setdefault(block_hash, block)
        return max(full, already)

    def release(self, blocks: list[int]) -> None:
        """Drop a request's blocks. As in vLLM the tail blocks are queued first, so they are
        evicted before the prompt's head (which other requests are likelier to share); blocks
        without a hash cache nothing and go to the front, to be reused first."""
        for block in reversed(blocks):
            self.ref_count[block] -= 1
            if self.ref_count[block] == 0:
                if self.block_hash[block] is None:
                    # Blocks without a hash are worthless: evict them before cached ones.
                    self.free[block] = None
                    self.free.move_to_end(block, last=False)
                else:
                    self.free[block] = None
        blocks.clear()
