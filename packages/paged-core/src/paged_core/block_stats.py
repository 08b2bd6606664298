"""What the block manager reports to operators: ``BlockManagerStats``."""

from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = ["MISS_REASONS", "BlockManagerStats"]

# Why prompt tokens were not served from the prefix cache (see BlockManagerStats).
MISS_REASONS = ("too_short", "evicted", "never_seen")


@dataclass(slots=True)
class BlockManagerStats:
    """The block manager's counters, kept as events happen, and its occupancy,
    filled in by ``stats()``. The ``prefix_*`` counters count prompt tokens
    once per prompt: queries = hits + the three kinds of miss."""

    prefix_queries_tokens: int = 0
    prefix_hits_tokens: int = 0
    # The last prompt token's block, never matched (its logits must be
    # computed): a prompt of at most one block can never hit.
    prefix_miss_too_short_tokens: int = 0
    prefix_miss_evicted_tokens: int = 0  # full blocks cached, then evicted (or their prefix)
    prefix_miss_never_seen_tokens: int = 0  # full blocks no earlier prompt computed
    forks: int = 0
    cow_copies: int = 0
    num_blocks: int = 0
    block_size: int = 0
    blocks_used: int = 0
    blocks_free: int = 0  # blocks_cached_free included
    blocks_cached_free: int = 0  # free, still holding cached KV: evicted least recently freed first
    tokens_used: int = 0  # every live sequence's reserved tokens: shared blocks count per sequence
    usage: float = 0.0  # blocks_used / num_blocks
    hit_rate: float = 0.0
    evictions: int = 0

    def as_dict(self) -> dict[str, float]:
        """Flat name -> number map, as pools' ``stats()`` and metrics endpoints report it."""
        return asdict(self)
