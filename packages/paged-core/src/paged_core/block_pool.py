"""The blocks: ref counts, one free queue and the prefix index.

A ``Block`` carries its ref count, prefix key and token ids. Free blocks wait
in one queue, an ``OrderedDict`` (O(1) to pop the front, push at either end or
take a block out of the middle on a prefix hit): blocks caching nothing at the
front, handed out first; blocks still caching KV behind them, evicted least
recently freed first. The pool knows blocks; the block manager knows sequences.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import chain

from paged_core.errors import OutOfBlocksError

BlockHash = bytes


def hash_block_tokens(parent: BlockHash | None, tokens: Sequence[int]) -> BlockHash:
    """Chained key of one full block, so equal keys mean equal prefixes.
    blake2b, unlike ``hash()``, is stable across processes; a root hashes
    ``block_size * 8`` bytes and a child 16 more, so they never coincide."""
    h = hashlib.blake2b(digest_size=16)
    if parent is not None:
        h.update(parent)
    h.update(array("q", tokens).tobytes())
    return h.digest()


def root_key(extra_key: bytes | None) -> BlockHash | None:
    """The parent of a sequence's first block: None, or a key derived from
    ``extra_key`` (what else its KV depends on besides the tokens, e.g. a
    LoRA adapter), so equal tokens under another extra key never match."""
    if extra_key is None:
        return None
    return hashlib.blake2b(extra_key, digest_size=16, person=b"paged-extra-key").digest()


@dataclass(slots=True, eq=False)  # eq=False: blocks compare and hash by identity
class Block:
    """One physical KV block; ``block_hash`` and ``token_ids`` are set while
    it holds registered prefix content, in use or free."""

    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None
    token_ids: tuple[int, ...] = ()
    group: int = 0  # the KV cache group that last took it


class BlockPool:
    """``num_blocks`` blocks, the free queue and the prefix index ``(group,
    key) -> block`` (groups never share a block). A key names one block and a
    block holds one key: of two equal contents, the first registered wins."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[Block, None] = OrderedDict.fromkeys(self.blocks)
        self.prefix_index: dict[tuple[int, BlockHash], Block] = {}
        self.used_per_group: dict[int, int] = {}  # kept at every 0 <-> 1 ref-count step
        self.num_cached_free = 0  # free blocks still caching KV (evictable)
        self.evictions = 0
        # Recently evicted keys (bounded), so a prefix miss can say "evicted".
        self.evicted_keys: OrderedDict[tuple[int, BlockHash], None] = OrderedDict()
        self.evicted_keys_limit = max(1024, 4 * num_blocks)

    def get_new_blocks(self, n: int, group: int = 0) -> list[Block]:
        """Take ``n`` blocks (ref count 1) off the front of the free queue for
        ``group``, evicting what they cached. ``OutOfBlocksError``, with
        nothing changed, when fewer are free."""
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
            if block.block_hash is not None:  # evicted
                key = (block.group, block.block_hash)
                self.evicted_keys[key] = None
                self.evicted_keys.move_to_end(key)  # evicted again: the newest
                if len(self.evicted_keys) > self.evicted_keys_limit:
                    self.evicted_keys.popitem(last=False)
                self._uncache(block)
                self.num_cached_free -= 1
                self.evictions += 1
            block.ref_count, block.group = 1, group
            out.append(block)
        self._count_used(group, n)
        return out

    def acquire(self, block: Block) -> None:
        """Add a reference (a prefix hit, a fork); a free block leaves the queue."""
        if block.ref_count == 0:
            del self.free_queue[block]
            self.num_cached_free -= block.block_hash is not None
            self._count_used(block.group, 1)
        block.ref_count += 1

    def free(self, blocks: Iterable[Block]) -> None:
        """Drop one reference to each block, in order; one left with none joins
        the back of the queue if it caches KV, else the front. A double free
        or another pool's block is a ``ValueError`` before any change."""
        blocks = list(blocks)
        for block, n in Counter(blocks).items():
            self._check_own(block)
            if n > block.ref_count:
                why = "it is already free" if not block.ref_count else (
                    f"freed {n} times in one call but it has only {block.ref_count} reference(s)"
                )
                raise ValueError(f"double free of block {block.block_id}: {why}")
        for block in blocks:
            block.ref_count -= 1
            if block.ref_count == 0:
                self._enqueue(block)

    def reclaim(self, block: Block) -> None:
        """Free a leaked block whatever its ref count, dropping its content."""
        self._check_own(block)
        if block.ref_count:
            block.ref_count = 0
            self._uncache(block)
            self._enqueue(block)

    def lookup(self, block_hash: BlockHash, tokens: Sequence[int], group: int = 0) -> Block | None:
        """``group``'s block caching ``tokens`` under ``block_hash``, or None;
        the tokens are compared too, so a hash collision never serves wrong KV."""
        block = self.prefix_index.get((group, block_hash))
        return block if block is not None and block.token_ids == tuple(tokens) else None

    def register(self, block: Block, block_hash: BlockHash, tokens: Sequence[int]) -> bool:
        """Index ``block`` (in use, its KV computed) as caching ``tokens`` under
        ``block_hash``; whether it became cached."""
        assert block.ref_count > 0, "only a block in use is registered"
        key = (block.group, block_hash)
        if block.block_hash is not None or key in self.prefix_index:
            return False
        block.block_hash, block.token_ids = block_hash, tuple(tokens)
        self.prefix_index[key] = block
        return True

    def audit(self, page_tables: Iterable[Sequence[Block]], block_size: int) -> list[str]:
        """Every disagreement between ref counts, the ``page_tables`` holding
        blocks, the free queue, the counts kept and the prefix index; empty
        when healthy. A referenced block on the free queue would be handed out
        twice; an unreferenced one off it is lost for good."""
        held = Counter(chain.from_iterable(page_tables))
        problems = [f"a page table points at unknown block id {b.block_id}" for b in held if not self._owns(b)]
        problems += [f"free list holds unknown block id {b.block_id}" for b in self.free_queue if not self._owns(b)]
        for block in self.blocks:
            b, refs, holds = block.block_id, block.ref_count, held[block]
            if refs != holds:
                kind = "miscounted" if holds else "leaked"
                problems.append(f"block {b} ({kind}) has ref count {refs} but {holds} page tables hold it")
            if bool(refs) == (block in self.free_queue):
                where = "on the free list (it can be handed out while in use)" if refs else (
                    "on no free list (lost: it can never be handed out)"
                )
                problems.append(f"block {b} has ref count {refs} but is {where}")
            if block.block_hash is not None and (
                self.prefix_index.get((block.group, block.block_hash)) is not block
                or len(block.token_ids) != block_size
            ):
                problems.append(f"cached block {b} is not indexed under its key with {block_size} tokens")
        problems += [
            f"prefix index maps a key to block {block.block_id}, cached under another"
            for key, block in self.prefix_index.items()
            if not self._owns(block) or (block.group, block.block_hash) != key
        ]
        counts = (sum(b.block_hash is not None for b in self.free_queue), self.num_cached_free)
        if counts[0] != counts[1]:
            problems.append(f"{counts[0]} cached free blocks counted as {counts[1]}")
        counted = {g: n for g, n in self.used_per_group.items() if n}
        if counted != Counter(b.group for b in self.blocks if b.ref_count):
            problems.append(f"blocks in use per group counted as {counted}, not as the blocks say")
        return problems

    def _enqueue(self, block: Block) -> None:
        self._count_used(block.group, -1)
        self.free_queue[block] = None
        if block.block_hash is None:
            self.free_queue.move_to_end(block, last=False)
        else:
            self.num_cached_free += 1

    def _count_used(self, group: int, n: int) -> None:
        self.used_per_group[group] = self.used_per_group.get(group, 0) + n  # dict beats Counter

    def _uncache(self, block: Block) -> None:
        if block.block_hash is not None:
            del self.prefix_index[(block.group, block.block_hash)]
            block.block_hash, block.token_ids = None, ()

    def _owns(self, block: Block) -> bool:
        return 0 <= block.block_id < len(self.blocks) and self.blocks[block.block_id] is block

    def _check_own(self, block: Block) -> None:
        if not self._owns(block):
            raise ValueError(f"unknown block {block.block_id}: not a block of this pool")
