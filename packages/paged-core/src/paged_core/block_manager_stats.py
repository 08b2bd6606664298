"""Counters an operator reads off the block manager (KV usage, prefix-cache hit rate, churn)."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(slots=True)
class BlockManagerStats:
    """A snapshot of the block manager.

    ``blocks_free`` includes ``blocks_cached_free`` (free blocks still holding
    prefix-cache content, evicted least recently used first). ``tokens_used``
    sums every live sequence's reserved length, so tokens in shared blocks
    count once per sequence. ``usage`` is ``blocks_used / num_blocks``.
    ``prefix_*`` count prompt tokens looked up and served from the cache."""

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
    hit_rate: float
    evictions: int
    forks: int
    cow_copies: int
    preemptions: int

    def as_dict(self) -> dict[str, float]:
        """Flat name -> number map, as pools' ``stats()`` and metrics endpoints report it."""
        return asdict(self)
