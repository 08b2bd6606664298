"""The KV cache coordinator: one page table per KV cache group over one pool of blocks.

A hybrid model (Gemma 3: sliding-window layers beside global ones) keeps
one ``BlockManager`` per ``KVCacheGroup``, all taking blocks from one shared
``BlockPool``; a block id belongs to one group at a time. A sliding group's
manager frees blocks that fall wholly out of the window, and its page-table
entries for them become the *null block*: one block id reserved (the last
of the cache tensors), never handed out, written or ref-counted, so tables
keep one entry per block position. Prefix keys of each group chain from
their own salt, so two groups never share a key.

The coordinator answers the pool's questions over every group at once (free
blocks needed summed, so ``can_allocate`` / ``can_append`` stay exact),
finds the longest prefix hit every group can serve, and counts each prompt
once (group 0's counters). With one group it passes every call through to
that group's manager: no null block, no salt, today's behaviour exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from paged_core.block_manager import BlockManager, check_prompt
from paged_core.block_pool import Block, BlockHash, BlockPool, hash_block_tokens
from paged_core.block_stats import BlockManagerStats
from paged_core.errors import OutOfBlocksError
from paged_core.kv_cache_groups import KVCacheGroup

__all__ = ["KVCacheCoordinator"]

Hits = list[tuple[Block, BlockHash]]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _salt(group: int) -> BlockHash | None:
    """Group 0 chains from nothing (a one-group pool keeps today's keys)."""
    return None if group == 0 else hash_block_tokens(None, [-1, group])


class KVCacheCoordinator:
    """Page tables of every KV cache group over one ``BlockPool`` (see module doc).

    ``num_blocks`` counts the blocks of the cache tensors; when some group
    slides, the last one is the null block and ``num_blocks - 1`` are usable."""

    def __init__(
        self,
        groups: Sequence[KVCacheGroup],
        num_blocks: int,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
    ) -> None:
        if not groups:
            raise ValueError("a KV cache coordinator needs at least one group")
        self.groups = list(groups)
        sliding = any(g.sliding_window is not None for g in self.groups)
        if sliding and num_blocks < 1:
            raise ValueError("a pool with sliding-window groups needs a block for the null block")
        usable = num_blocks - 1 if sliding else num_blocks
        self.block_pool = BlockPool(usable)
        self.null_block = Block(usable) if sliding else None  # outside block_pool: never free
        self.num_blocks, self.block_size = usable, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.managers = [
            BlockManager(
                usable, block_size, enable_prefix_caching, block_pool=self.block_pool,
                sliding_window=group.sliding_window,
                null_block=self.null_block if group.sliding_window is not None else None,
                hash_salt=_salt(g), group=g,
            )
            for g, group in enumerate(self.groups)
        ]  # fmt: skip
        self._first = self.managers[0]

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def null_block_id(self) -> int | None:
        """The block id released entries point at (None: no group slides)."""
        return None if self.null_block is None else self.null_block.block_id

    # -- admission -------------------------------------------------------
    def num_blocks_needed(
        self, num_tokens: int, token_ids: Sequence[int] | None = None, *,
        skip_prefix_cache: bool = False,
    ) -> int:  # fmt: skip
        """Free blocks ``allocate`` takes, over every group."""
        if len(self.managers) == 1:
            return self._first.num_blocks_needed(
                num_tokens, token_ids, skip_prefix_cache=skip_prefix_cache
            )
        return self._plan(num_tokens, token_ids, skip_prefix_cache)[1]

    def can_allocate(
        self, num_tokens: int, token_ids: Sequence[int] | None = None, *,
        skip_prefix_cache: bool = False,
    ) -> bool:  # fmt: skip
        """Whether ``allocate`` would succeed now (exact over every group)."""
        needed = self.num_blocks_needed(num_tokens, token_ids, skip_prefix_cache=skip_prefix_cache)
        return needed <= self.num_free_blocks()

    def allocate(
        self, seq_id: int, num_tokens: int, token_ids: Sequence[int] | None = None, *,
        skip_prefix_cache: bool = False,
    ) -> int:  # fmt: skip
        """Reserve the prompt's blocks in every group; returns the tokens served
        from the prefix cache (the same in every group). All or nothing."""
        if len(self.managers) == 1:
            return self._first.allocate(
                seq_id, num_tokens, token_ids, skip_prefix_cache=skip_prefix_cache
            )
        if self._first.has_seq(seq_id):
            raise ValueError(
                f"sequence {seq_id} already has blocks; free it before allocating again"
            )
        hits, needed = self._plan(num_tokens, token_ids, skip_prefix_cache)
        if needed > self.num_free_blocks():
            raise OutOfBlocksError(
                f"sequence {seq_id} needs {needed} free blocks for {num_tokens} tokens in "
                f"{self.num_groups} KV cache groups but only {self.num_free_blocks()} of "
                f"{self.num_blocks} are free; wait for sequences to finish or preempt one"
            )
        # Pin every group's hits first: another group's fresh blocks must not evict them.
        pinned = [b for group_hits in hits for b, _ in group_hits if b is not self.null_block]
        for block in pinned:
            self.block_pool.acquire(block)
        cached = [
            manager.allocate(
                seq_id, num_tokens, token_ids, skip_prefix_cache=skip_prefix_cache, hits=group_hits
            )
            for manager, group_hits in zip(self.managers, hits, strict=True)
        ]
        self.block_pool.free(pinned)
        return cached[0]

    # -- growth ----------------------------------------------------------
    def can_append(self, seq_ids: Sequence[int], num_tokens: int = 1) -> bool:
        """Whether every sequence can grow by ``num_tokens`` in every group now."""
        needed = sum(m.num_blocks_to_append(seq_ids, num_tokens) for m in self.managers)
        return needed <= self.num_free_blocks()

    def append(self, seq_id: int, token_id: int | None = None) -> list[tuple[int, int]]:
        """Room for one more token in every group; the ``(src, dst)`` block
        copies the pool must make (copy-on-write), all groups together."""
        return [pair for copies in self.append_per_group(seq_id, token_id) for pair in copies]

    def append_per_group(
        self, seq_id: int, token_id: int | None = None
    ) -> list[list[tuple[int, int]]]:
        """``append``, with each group's copies apart (the pool mirrors tables per group).
        All or nothing: the blocks every group needs are checked first."""
        if len(self.managers) == 1:
            return [self._first.append(seq_id, token_id)]
        needed = sum(m.blocks_to_append(seq_id) for m in self.managers)
        if needed > self.num_free_blocks():
            raise OutOfBlocksError(
                f"sequence {seq_id} needs a block in each of {self.num_groups} KV cache groups "
                f"but only {self.num_free_blocks()} are free; preempt a sequence first"
            )
        return [manager.append(seq_id, token_id) for manager in self.managers]

    def mark_computed(self, seq_id: int, num_computed_tokens: int) -> bool:
        """Commit in every group (sliding groups free what left the window);
        returns whether some group freed blocks just now."""
        released = False
        for manager in self.managers:
            released |= manager.mark_computed(seq_id, num_computed_tokens)
        return released

    # -- release ---------------------------------------------------------
    def free(self, seq_id: int) -> None:
        """Release the sequence in every group (also what a preemption does)."""
        for manager in self.managers:
            manager.free(seq_id)

    def fork(self, parent: int, child: int) -> None:
        """Share every group's blocks with ``child`` copy-on-write."""
        for manager in self.managers:
            manager.fork(parent, child)

    # -- queries ---------------------------------------------------------
    def block_table(self, seq_id: int, group: int = 0) -> list[int]:
        """The sequence's block ids in ``group``, in token order (released
        entries are the null block id)."""
        return self.managers[group].block_table(seq_id)

    def blocks_from(self, seq_id: int, start: int, group: int = 0) -> list[int]:
        return self.managers[group].blocks_from(seq_id, start)

    def num_released(self, seq_id: int, group: int) -> int:
        """Leading entries of the group's table that are the null block."""
        return self.managers[group].num_released(seq_id)

    def num_tokens(self, seq_id: int) -> int:
        return self._first.num_tokens(seq_id)

    def num_computed_tokens(self, seq_id: int) -> int:
        return self._first.num_computed_tokens(seq_id)

    def has_seq(self, seq_id: int) -> bool:
        return self._first.has_seq(seq_id)

    def seq_ids(self) -> list[int]:
        return self._first.seq_ids()

    def num_free_blocks(self) -> int:
        """Free blocks of the shared pool (evictable cached ones included)."""
        return len(self.block_pool.free_queue)

    def free_token_capacity(self) -> int:
        """Tokens the free blocks hold when every group stores them (a new
        prompt's tokens do, until they leave a window): free blocks x
        block_size / groups."""
        return self.num_free_blocks() * self.block_size // self.num_groups

    def group_blocks_used(self) -> list[int]:
        """Blocks each group holds (the pool counts them as they are taken
        and given back, so this costs nothing per step)."""
        return [self.block_pool.used_per_group.get(g, 0) for g in range(self.num_groups)]

    def stats(self) -> BlockManagerStats:
        """The shared pool's occupancy and group 0's prompt counters (each
        prompt counted once); copy-on-write copies summed over groups;
        ``tokens_capacity_free`` as ``free_token_capacity``."""
        first = self._first.stats()
        if len(self.managers) == 1:
            return first
        return replace(
            first,
            tokens_capacity_free=self.free_token_capacity(),
            cow_copies=sum(m.counters.cow_copies for m in self.managers),
        )

    # -- health ----------------------------------------------------------
    def audit(self) -> list[str]:
        """Every group's audit (ref counts checked once, against all tables;
        the null block is in none of them) and the groups against each other."""
        if len(self.managers) == 1:
            return self._first.audit()
        problems: list[str] = []
        for g, manager in enumerate(self.managers):
            if manager.seq_ids() != self._first.seq_ids():
                problems.append(f"KV cache group {g} holds other sequences than group 0")
            for problem in manager.audit_tables():
                problems.append(f"KV cache group {g}: {problem}")
        tables = [t for m in self.managers for t in m.live_tables()]
        return problems + self.block_pool.audit(tables, self.block_size)

    def reclaim_leaked(self) -> list[int]:
        """Free blocks in use that no group's page table points at."""
        held = {b.block_id for m in self.managers for t in m.live_tables() for b in t}
        leaked = [b for b in self.block_pool.blocks if b.ref_count and b.block_id not in held]
        for block in leaked:
            self.block_pool.reclaim(block)
        return [block.block_id for block in leaked]

    # -- internals -------------------------------------------------------
    def _plan(
        self, num_tokens: int, token_ids: Sequence[int] | None, skip_prefix_cache: bool
    ) -> tuple[list[Hits], int]:
        """Each group's hits for the longest prefix every group can serve,
        and the free blocks the prompt needs over all groups. A full group
        needs blocks ``0..h-1`` cached; a sliding group of window W only
        those covering positions ``[h - W + 1, h)`` (earlier entries are the
        null block): ``h`` starts at the full groups' run and drops a block
        at a time until every sliding group has its window cached."""
        check_prompt(num_tokens, token_ids)
        bs = self.block_size
        lookup = self.enable_prefix_caching and not skip_prefix_cache
        found: list[list[tuple[Block | None, BlockHash]]] = [[] for _ in self.groups]
        h = 0
        if lookup and token_ids is not None and self.block_pool.prefix_index:
            h = (num_tokens - 1) // bs  # never the block of the last prompt token
            for g, group in enumerate(self.groups):
                found[g] = self._lookup(g, token_ids, h, stop_at_miss=group.sliding_window is None)
                if group.sliding_window is None:
                    h = min(h, next((i for i, (b, _) in enumerate(found[g]) if b is None), h))
            while h and not all(self._window_cached(g, found[g], h) for g in range(len(found))):
                h -= 1
        hits: list[Hits] = []
        needed = 0
        for g, group in enumerate(self.groups):
            first = self._window_first_block(group, h)
            group_hits: Hits = [
                (self.null_block if i < first else block, key)  # type: ignore[misc]
                for i, (block, key) in enumerate(found[g][:h])
            ]
            hits.append(group_hits)
            free_hits = sum(1 for b, _ in group_hits[first:] if b.ref_count == 0)
            needed += _cdiv(num_tokens, bs) - h + free_hits
        return hits, needed

    def _lookup(
        self, g: int, token_ids: Sequence[int], n: int, *, stop_at_miss: bool
    ) -> list[tuple[Block | None, BlockHash]]:
        """Group ``g``'s cached block (or None) and key for blocks ``0..n-1``."""
        bs, parent, out = self.block_size, _salt(g), []
        for i in range(n):
            tokens = token_ids[i * bs : (i + 1) * bs]
            parent = hash_block_tokens(parent, tokens)
            block = self.block_pool.lookup(parent, tokens)
            out.append((block, parent))
            if block is None and stop_at_miss:
                break
        return out

    def _window_first_block(self, group: KVCacheGroup, h: int) -> int:
        """First block a hit of ``h`` blocks needs in ``group`` (0 when full)."""
        if group.sliding_window is None:
            return 0
        return max(0, h * self.block_size - group.sliding_window + 1) // self.block_size

    def _window_cached(self, g: int, found: list[tuple[Block | None, BlockHash]], h: int) -> bool:
        first = self._window_first_block(self.groups[g], h)
        return len(found) >= h and all(b is not None for b, _ in found[first:h])
