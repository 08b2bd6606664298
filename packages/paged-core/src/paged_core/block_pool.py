"""Which free block to hand out next, and what happens to a block's cached KV.

Free blocks come in two kinds. *Plain* free blocks hold nothing worth keeping
and are handed out first. *Cached* free blocks keep the KV of a prefix
registered in the ``PrefixCache``; they stay in the allocator's free list in
the order they were freed and are evicted least recently freed first, only
when no plain block is left. A prefix hit takes a cached free block back out
of the free list in O(1) (``BlockAllocator.take``).

The pool knows blocks; the block manager knows sequences.
"""

from __future__ import annotations

from collections.abc import Iterable

from paged_core.block_allocator import BlockAllocator, Owner
from paged_core.prefix_cache import PrefixCache


class BlockPool:
    """Ref-counted blocks plus the prefix cache, with plain-first, then LRU, reuse."""

    def __init__(self, num_blocks: int) -> None:
        self.allocator = BlockAllocator(num_blocks)
        self.cache = PrefixCache()
        # Reversed so that a fresh pool hands out 0, 1, 2, ... (dict.popitem is LIFO).
        self._free_plain: dict[int, None] = dict.fromkeys(range(num_blocks - 1, -1, -1))
        self.evictions = 0

    def num_free(self) -> int:
        """Free blocks, cached ones included."""
        return self.allocator.num_free()

    def num_cached_free(self) -> int:
        """Free blocks that still hold cached KV (evictable)."""
        return self.allocator.num_free() - len(self._free_plain)

    def is_plain_free(self, block_id: int) -> bool:
        """Whether ``block_id`` is listed as free with no cached content."""
        return block_id in self._free_plain

    def plain_free_blocks(self) -> list[int]:
        """The plain free list's ids (for audits)."""
        return list(self._free_plain)

    def allocate_fresh(self, n: int, owner: Owner) -> list[int]:
        """Hand out ``n`` free blocks to write new KV into: plain ones first,
        then cached ones least recently freed first (evicting their content).
        The caller has checked that ``n`` blocks are free."""
        out = []
        for _ in range(n):
            if self._free_plain:
                block_id, _ = self._free_plain.popitem()
                self.allocator.take(block_id, owner=owner)
            else:
                (block_id,) = self.allocator.allocate(1, owner=owner)
                evicted = self.cache.evict(block_id)
                assert evicted, f"free block {block_id} was neither plain nor cached"
                self.evictions += 1
            out.append(block_id)
        return out

    def acquire_hit(self, block_id: int, owner: Owner) -> None:
        """Add a reference to a prefix-cache hit: out of the free list if it is
        free (it is cached, so not plain), shared if it is in use."""
        if self.allocator.is_free(block_id):
            self.allocator.take(block_id, owner=owner)
        else:
            self.allocator.share(block_id, owner=owner)

    def release(self, block_ids: Iterable[int], owner: Owner) -> None:
        """Drop ``owner``'s reference to each block, in the given order; blocks
        that become free keep their cached content if they have any."""
        for block_id in self.allocator.free(block_ids, owner=owner):
            if not self.cache.is_cached(block_id):
                self._free_plain[block_id] = None

    def reclaim(self, block_id: int) -> None:
        """Free a leaked block whatever its ref count, dropping its content."""
        self.cache.evict(block_id)
        self.allocator.force_free(block_id)
        self._free_plain[block_id] = None
