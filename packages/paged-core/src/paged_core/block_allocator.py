"""Reference-counted allocator of physical KV block ids.

Ids are integers in ``[0, total_blocks)``. Allocation and free are O(1): the
free ids live in an ``OrderedDict`` used as an ordered set (insertion order =
reuse order, so the least recently freed id is handed out first), and an id
can also be taken out of the middle in O(1). A plain dict is not enough:
popping its first key over and over scans the deleted entries left at the
front, which made allocating a large pool block by block quadratic.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable

from paged_core.errors import OutOfBlocksError

Owner = Hashable


class BlockAllocator:
    """Hands out block ids with reference counts and owner tracking.

    A block is free again only when its reference count reaches 0. Freeing
    a free block, or an id outside the pool, is a ``ValueError`` (a bug in
    the caller), never silently ignored.
    """

    def __init__(self, total_blocks: int) -> None:
        if total_blocks < 0:
            raise ValueError(f"total_blocks must be >= 0, got {total_blocks}")
        self.total_blocks = total_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(total_blocks))
        self._ref_counts: list[int] = [0] * total_blocks
        self._owners: list[set[Owner]] = [set() for _ in range(total_blocks)]

    # -- queries ---------------------------------------------------------
    def num_free(self) -> int:
        """Blocks with reference count 0."""
        return len(self._free)

    def num_allocated(self) -> int:
        """Blocks with reference count >= 1."""
        return self.total_blocks - len(self._free)

    def can_allocate(self, n: int) -> bool:
        """Whether ``allocate(n)`` would succeed."""
        return 0 <= n <= len(self._free)

    def ref_count(self, block_id: int) -> int:
        """Current reference count of ``block_id``."""
        self._check_id(block_id)
        return self._ref_counts[block_id]

    def is_free(self, block_id: int) -> bool:
        """Whether ``block_id`` is on the free list, i.e. has no references (it
        may still hold cached content)."""
        self._check_id(block_id)
        return block_id in self._free

    def free_blocks(self) -> list[int]:
        """The free list's ids in reuse order (for audits: each must be a
        valid id with ref count 0, and every such id must be on it)."""
        return list(self._free)

    def owners(self, block_id: int) -> frozenset[Owner]:
        """Owners that currently hold a reference to ``block_id``."""
        self._check_id(block_id)
        return frozenset(self._owners[block_id])

    def allocated_blocks(self) -> list[int]:
        """Every block id with a reference count >= 1, ascending."""
        return [b for b in range(self.total_blocks) if self._ref_counts[b] > 0]

    # -- mutation --------------------------------------------------------
    def allocate(self, n: int, owner: Owner | None = None) -> list[int]:
        """Take ``n`` free blocks (ref count 1 each). All or nothing."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > len(self._free):
            raise OutOfBlocksError(
                f"cannot allocate {n} blocks: only {len(self._free)} of "
                f"{self.total_blocks} are free"
            )
        ids = [self._free.popitem(last=False)[0] for _ in range(n)]
        for block_id in ids:
            assert self._ref_counts[block_id] == 0, "a free block must have no references"
            self._ref_counts[block_id] = 1
            if owner is not None:
                self._owners[block_id].add(owner)
        return ids

    def take(self, block_id: int, owner: Owner | None = None) -> None:
        """Allocate one specific free block (O(1)); used for prefix-cache
        hits on blocks that were freed but still hold content."""
        self._check_id(block_id)
        if block_id not in self._free:
            raise ValueError(
                f"block {block_id} is not free (ref count {self._ref_counts[block_id]})"
            )
        del self._free[block_id]
        self._ref_counts[block_id] = 1
        if owner is not None:
            self._owners[block_id].add(owner)

    def share(self, block_id: int, owner: Owner | None = None) -> None:
        """Add a reference to an allocated block (copy-on-write sharing)."""
        self._check_id(block_id)
        if self._ref_counts[block_id] == 0:
            raise ValueError(f"cannot share block {block_id}: it is free")
        self._ref_counts[block_id] += 1
        if owner is not None:
            self._owners[block_id].add(owner)

    def free(self, block_ids: int | Iterable[int], owner: Owner | None = None) -> list[int]:
        """Drop one reference to each block; returns the ids that became free.

        Raises ``ValueError`` on an unknown id or a block that is already free
        (double free); nothing is changed in that case."""
        ids = [block_ids] if isinstance(block_ids, int) else list(block_ids)
        pending: dict[int, int] = {}
        for block_id in ids:
            self._check_id(block_id)
            pending[block_id] = pending.get(block_id, 0) + 1
            if self._ref_counts[block_id] == 0:
                raise ValueError(f"double free of block {block_id}: it is already free")
            if pending[block_id] > self._ref_counts[block_id]:
                raise ValueError(
                    f"double free of block {block_id}: freed {pending[block_id]} times in one "
                    f"call but it has only {self._ref_counts[block_id]} reference(s)"
                )
        released = []
        for block_id in ids:
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._owners[block_id].clear()
                self._free[block_id] = None
                released.append(block_id)
            elif owner is not None:
                self._owners[block_id].discard(owner)
        return released

    def force_free(self, block_id: int) -> None:
        """Free a block whatever its reference count (leak recovery)."""
        self._check_id(block_id)
        if block_id in self._free:
            return
        self._ref_counts[block_id] = 0
        self._owners[block_id].clear()
        self._free[block_id] = None

    # -- audits ----------------------------------------------------------
    def find_leaked_blocks(self, active_owners: Iterable[Owner]) -> list[int]:
        """Allocated blocks none of whose owners is still active."""
        active = set(active_owners)
        return [
            b
            for b in range(self.total_blocks)
            if self._ref_counts[b] > 0 and not (self._owners[b] & active)
        ]

    def find_unreferenced_blocks(self, referenced: Iterable[int]) -> list[int]:
        """Allocated blocks that no page table (``referenced``) points at."""
        seen = set(referenced)
        return [b for b in range(self.total_blocks) if self._ref_counts[b] > 0 and b not in seen]

    def _check_id(self, block_id: int) -> None:
        if not 0 <= block_id < self.total_blocks:
            raise ValueError(
                f"unknown block id {block_id}: valid ids are 0..{self.total_blocks - 1}"
            )
