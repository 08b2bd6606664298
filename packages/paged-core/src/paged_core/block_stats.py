"""What the block manager reports to operators: ``BlockManagerStats``."""

from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = ["MISS_REASONS", "BlockManagerStats"]

# Why prompt tokens were not served from the prefix cache (see BlockManagerStats).
MISS_REASONS = ("too_short", "evicted", "never_seen")


@dataclass(slots=True)
class BlockManagerStats:
    """The block manager's counters (kept as events happen) and occupancy
    (filled in by ``stats()``).

    ``prefix_*`` count prompt tokens looked up and served from the cache,
    once per prompt; the tokens not served are split by why (``queries =
    hits + the three misses``): ``prefix_miss_too_short_tokens`` are those
    of the block holding the last prompt token, which is never matched (its
    logits must be computed), so a prompt of at most one block can never
    hit; ``prefix_miss_evicted_tokens`` are full blocks whose content was
    cached and evicted (or whose cached prefix was);
    ``prefix_miss_never_seen_tokens`` full blocks no earlier prompt computed.
    ``blocks_free`` includes ``blocks_cached_free`` (free blocks still holding
    prefix-cache content, evicted least recently freed first). ``tokens_used``
    sums every live sequence's reserved length, so tokens in shared blocks
    count once per sequence. ``usage`` is ``blocks_used / num_blocks``."""

    prefix_queries_tokens: int = 0
    prefix_hits_tokens: int = 0
    prefix_miss_too_short_tokens: int = 0
    prefix_miss_evicted_tokens: int = 0
    prefix_miss_never_seen_tokens: int = 0
    forks: int = 0
    cow_copies: int = 0
    num_blocks: int = 0
    block_size: int = 0
    blocks_used: int = 0
    blocks_free: int = 0
    blocks_cached_free: int = 0
    tokens_used: int = 0
    tokens_capacity_free: int = 0
    usage: float = 0.0
    hit_rate: float = 0.0
    evictions: int = 0

    def as_dict(self) -> dict[str, float]:
        """Flat name -> number map, as pools' ``stats()`` and metrics endpoints report it."""
        return asdict(self)
