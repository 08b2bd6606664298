"""The block layer's counters: what the pool reports to operators.

``PrefixCounters`` counts prompt tokens looked up in the prefix cache, the
ones served, and the ones missed by reason, once per prompt;
``BlockManagerStats`` is the snapshot ``stats()`` returns.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from paged_core.block_pool import BlockHash, BlockPool, hash_block_tokens

__all__ = ["MISS_REASONS", "BlockManagerStats", "PrefixCounters"]

# Why prompt tokens were not served from the prefix cache (see BlockManagerStats).
MISS_REASONS = ("too_short", "evicted", "never_seen")


@dataclass(slots=True)
class BlockManagerStats:
    """A snapshot of the block manager's counters.

    ``blocks_free`` includes ``blocks_cached_free`` (free blocks still holding
    prefix-cache content, evicted least recently freed first). ``tokens_used``
    sums every live sequence's reserved length, so tokens in shared blocks
    count once per sequence. ``usage`` is ``blocks_used / num_blocks``.
    ``prefix_*`` count prompt tokens looked up and served from the cache;
    the tokens not served are split by why (``queries = hits + the three
    misses``): ``prefix_miss_too_short_tokens`` are those of the block
    holding the last prompt token, which is never matched (its logits must
    be computed), so a prompt of at most one block can never hit;
    ``prefix_miss_evicted_tokens`` are full blocks whose content was cached
    and evicted (or whose cached prefix was); ``prefix_miss_never_seen_tokens``
    full blocks no earlier prompt computed."""

    num_blocks: int
    block_size: int
    blocks_used: int
    blocks_free: int
    blocks_cached_free: int
    tokens_used: int
    tokens_capacity_free: int
    usage: float
    prefix_queries_tokens: int
    prefix_hits_tokens: int
    prefix_miss_too_short_tokens: int
    prefix_miss_evicted_tokens: int
    prefix_miss_never_seen_tokens: int
    hit_rate: float
    evictions: int
    forks: int
    cow_copies: int

    def as_dict(self) -> dict[str, float]:
        """Flat name -> number map, as pools' ``stats()`` and metrics endpoints report it."""
        return asdict(self)


class PrefixCounters:
    """Prompt tokens looked up, served, and missed by reason (see
    ``BlockManagerStats``), plus forks and copy-on-write copies."""

    def __init__(self) -> None:
        self.queries = self.hits = self.forks = self.cow_copies = 0
        self.misses = dict.fromkeys(MISS_REASONS, 0)

    def count_prompt(
        self,
        pool: BlockPool,
        block_size: int,
        num_tokens: int,
        token_ids: Sequence[int] | None,
        num_hits: int,
        parent: BlockHash | None,
    ) -> None:
        """Count one prompt that hit ``num_hits`` leading blocks (``parent``:
        the last hit's key). A matchable block after the first miss is
        "evicted" when its key is still cached or was evicted (its prefix
        went), else "never seen"."""
        bs = block_size
        self.queries += num_tokens
        self.hits += num_hits * bs
        matchable = (num_tokens - 1) // bs
        self.misses["too_short"] += num_tokens - matchable * bs
        for i in range(num_hits, matchable):
            if token_ids is None:  # no ids: nothing could ever match
                self.misses["never_seen"] += (matchable - i) * bs
                return
            parent = hash_block_tokens(parent, token_ids[i * bs : (i + 1) * bs])
            seen = parent in pool.prefix_index or pool.was_evicted(parent)
            self.misses["evicted" if seen else "never_seen"] += bs

    def snapshot(self, pool: BlockPool, block_size: int, tokens_used: int) -> BlockManagerStats:
        """The counters with the pool's occupancy."""
        num_blocks, free = len(pool.blocks), len(pool.free_queue)
        return BlockManagerStats(
            num_blocks=num_blocks,
            block_size=block_size,
            blocks_used=num_blocks - free,
            blocks_free=free,
            blocks_cached_free=pool.num_cached_free(),
            tokens_used=tokens_used,
            tokens_capacity_free=free * block_size,
            usage=(num_blocks - free) / num_blocks if num_blocks else 0.0,
            prefix_queries_tokens=self.queries,
            prefix_hits_tokens=self.hits,
            prefix_miss_too_short_tokens=self.misses["too_short"],
            prefix_miss_evicted_tokens=self.misses["evicted"],
            prefix_miss_never_seen_tokens=self.misses["never_seen"],
            hit_rate=self.hits / self.queries if self.queries else 0.0,
            evictions=pool.evictions,
            forks=self.forks,
            cow_copies=self.cow_copies,
        )
