"""The blocks: ref counts, one free queue, and the prefix index.

Every physical block is one ``Block`` carrying its ref count, its prefix key
(or ``None``) and the token ids that key stands for. The free blocks form one
queue: blocks holding no cached KV at the front (handed out first, the most
recently freed first), blocks still holding cached KV behind them in the order
they were freed (evicted least recently freed first). The queue is an
``OrderedDict``, a linked list in C: popping the front, pushing at either end
and taking a block out of the middle (a prefix hit on a free cached block) are
all O(1).

The pool knows blocks; the block manager knows sequences.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from paged_core.errors import OutOfBlocksError

BlockHash = bytes


def hash_block_tokens(parent: BlockHash | None, tokens: Sequence[int]) -> BlockHash:
    """Chained key of one full block: blake2b over its parent's key (``None``
    for the first block) and its token ids as signed 64-bit integers, so equal
    keys mean the whole prefix matches; stable across processes, unlike
    ``hash()``. A root key hashes ``block_size * 8`` bytes and a child 16 more,
    so the two can never coincide by concatenation."""
    h = hashlib.blake2b(digest_size=16)
    if parent is not None:
        h.update(parent)
    h.update(array("q", tokens).tobytes())
    return h.digest()


@dataclass(slots=True, eq=False)  # eq=False: blocks compare and hash by identity
class Block:
    """One physical KV block. ``block_hash`` is set while the block holds
    registered prefix content (``token_ids``), whether it is free or not;
    ``group`` is the KV cache group that last took it (hybrid pools)."""

    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None
    token_ids: tuple[int, ...] = ()
    group: int = 0


class BlockPool:
    """``num_blocks`` blocks, the free queue and the prefix index
    (``(group, key)`` -> block: KV cache groups never share a block).

    A key maps to at most one block and a block holds at most one key: when
    two sequences compute the same content into different blocks, the first
    registration wins and the other block stays uncached."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.blocks = [Block(i) for i in range(num_blocks)]
        # front = next handed out; a fresh pool hands out 0, 1, 2, ...
        self.free_queue: OrderedDict[Block, None] = OrderedDict.fromkeys(self.blocks)
        self.prefix_index: dict[tuple[int, BlockHash], Block] = {}
        # Blocks in use per KV cache group, kept at each 0 <-> 1 ref-count step.
        self.used_per_group: dict[int, int] = {}  # a plain dict: Counter is slower here
        self.evictions = 0
        self._num_cached_free = 0
        # Keys evicted recently (bounded), so a prefix miss can say "evicted"
        # rather than "never seen".
        self.evicted_keys: OrderedDict[tuple[int, BlockHash], None] = OrderedDict()
        self.evicted_keys_limit = max(1024, 4 * num_blocks)

    def num_cached_free(self) -> int:
        """Free blocks that still hold cached KV (evictable)."""
        return self._num_cached_free

    def get_new_blocks(self, n: int, group: int = 0) -> list[Block]:
        """Take ``n`` blocks off the front of the free queue (ref count 1) for
        KV cache ``group`` to write new KV into, evicting the cached content
        of those that hold some. ``OutOfBlocksError`` when fewer are free;
        nothing changes then."""
        assert n >= 0, f"cannot take a negative number of blocks ({n})"
        if n > len(self.free_queue):
            raise OutOfBlocksError(
                f"cannot allocate {n} blocks: only {len(self.free_queue)} of "
                f"{len(self.blocks)} are free"
            )
        out = []
        for _ in range(n):
            block, _ = self.free_queue.popitem(last=False)
            assert block.ref_count == 0, "a free block must have no references"
            if block.block_hash is not None:
                self._remember_evicted((block.group, block.block_hash))
                self._uncache(block)
                self._num_cached_free -= 1
                self.evictions += 1
            block.ref_count, block.group = 1, group
            out.append(block)
        self._count_used(group, n)
        return out

    def acquire(self, block: Block) -> None:
        """Add a reference to ``block`` (a prefix hit, a fork); a free one
        (a hit on cached KV) leaves the free queue."""
        if block.ref_count == 0:
            del self.free_queue[block]
            if block.block_hash is not None:
                self._num_cached_free -= 1
            self._count_used(block.group, 1)
        block.ref_count += 1

    def free(self, blocks: Iterable[Block]) -> None:
        """Drop one reference to each block, in order. A block that becomes
        free joins the back of the queue if it holds cached KV, else the
        front. A double free (more drops than references) or a block of
        another pool is a ``ValueError``, raised before anything changes."""
        blocks = list(blocks)
        drops: dict[Block, int] = {}
        for block in blocks:
            self._check_own(block)
            n = drops[block] = drops.get(block, 0) + 1
            if block.ref_count == 0:
                raise ValueError(f"double free of block {block.block_id}: it is already free")
            if n > block.ref_count:
                raise ValueError(
                    f"double free of block {block.block_id}: freed {n} times in one call but "
                    f"it has only {block.ref_count} reference(s)"
                )
        for block in blocks:
            block.ref_count -= 1
            if block.ref_count == 0:
                self._count_used(block.group, -1)
                self.free_queue[block] = None
                if block.block_hash is None:
                    self.free_queue.move_to_end(block, last=False)
                else:
                    self._num_cached_free += 1

    def reclaim(self, block: Block) -> None:
        """Free a leaked block whatever its ref count, dropping its content."""
        self._check_own(block)
        if block.ref_count:
            block.ref_count = 0
            self._count_used(block.group, -1)
            self._uncache(block)
            self.free_queue[block] = None
            self.free_queue.move_to_end(block, last=False)

    def lookup(self, block_hash: BlockHash, tokens: Sequence[int], group: int = 0) -> Block | None:
        """Group ``group``'s block holding ``tokens`` under ``block_hash``, or
        ``None``. The tokens are compared too, so a hash collision never
        serves wrong KV."""
        block = self.prefix_index.get((group, block_hash))
        return block if block is not None and block.token_ids == tuple(tokens) else None

    def register(self, block: Block, block_hash: BlockHash, tokens: Sequence[int]) -> bool:
        """Record that ``block`` (in use, its KV now computed) holds ``tokens``
        under ``block_hash`` for its group. Returns whether it became cached."""
        assert block.ref_count > 0, "only a block in use is registered"
        key = (block.group, block_hash)
        if block.block_hash is not None or key in self.prefix_index:
            return False
        block.block_hash, block.token_ids = block_hash, tuple(tokens)
        self.prefix_index[key] = block
        return True

    def audit(self, page_tables: Iterable[Sequence[Block]], block_size: int) -> list[str]:
        """Every disagreement between the ref counts and the holders in
        ``page_tables``, the free queue and the prefix index (empty when
        healthy). A referenced block on the free queue would be handed out
        twice; an unreferenced block off it is lost for good."""
        problems: list[str] = []
        holders = [0] * len(self.blocks)
        for block in (block for table in page_tables for block in table):
            if self._owns(block):
                holders[block.block_id] += 1
            else:
                problems.append(f"a page table points at unknown block id {block.block_id}")
        for block in self.free_queue:
            if not self._owns(block):
                problems.append(f"free list holds unknown block id {block.block_id}")
        cached_free = sum(1 for b in self.free_queue if b.block_hash is not None)
        if cached_free != self._num_cached_free:
            problems.append(f"{cached_free} cached free blocks counted as {self._num_cached_free}")
        for block, holds in zip(self.blocks, holders, strict=True):
            b, refs = block.block_id, block.ref_count
            if refs != holds:
                kind = "leaked" if not holds else "miscounted"
                problems.append(
                    f"block {b} ({kind}) has ref count {refs} but {holds} page tables hold it"
                )
            if bool(refs) == (block in self.free_queue):
                where = "on the free list (it can be handed out while in use)" if refs else (
                    "on no free list (lost: it can never be handed out)"
                )
                problems.append(f"block {b} has ref count {refs} but is {where}")
            if block.block_hash is not None and (
                self.prefix_index.get((block.group, block.block_hash)) is not block
                or len(block.token_ids) != block_size
            ):
                problems.append(
                    f"cached block {b} is not indexed under its key with {block_size} tokens"
                )
        counted = {g: n for g, n in self.used_per_group.items() if n}
        if counted != Counter(b.group for b in self.blocks if b.ref_count):
            problems.append(f"blocks in use per group counted as {counted}, not as the blocks say")
        for (group, key), block in self.prefix_index.items():
            if not self._owns(block) or (block.group, block.block_hash) != (group, key):
                problems.append(
                    f"prefix index maps a key to block {block.block_id}, cached under another"
                )
        return problems

    def was_evicted(self, block_hash: BlockHash, group: int = 0) -> bool:
        """Whether ``block_hash`` was evicted recently from ``group`` (the
        last ``evicted_keys_limit`` evictions are remembered)."""
        return (group, block_hash) in self.evicted_keys

    def _remember_evicted(self, key: tuple[int, BlockHash]) -> None:
        self.evicted_keys[key] = None
        self.evicted_keys.move_to_end(key)
        if len(self.evicted_keys) > self.evicted_keys_limit:
            self.evicted_keys.popitem(last=False)

    def _count_used(self, group: int, n: int) -> None:
        self.used_per_group[group] = self.used_per_group.get(group, 0) + n

    def _uncache(self, block: Block) -> None:
        if block.block_hash is not None:
            del self.prefix_index[(block.group, block.block_hash)]
            block.block_hash, block.token_ids = None, ()

    def _owns(self, block: Block) -> bool:
        return 0 <= block.block_id < len(self.blocks) and self.blocks[block.block_id] is block

    def _check_own(self, block: Block) -> None:
        if not self._owns(block):
            raise ValueError(f"unknown block {block.block_id}: not a block of this pool")
