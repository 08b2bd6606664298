"""Block manager: each sequence's page tables over one ``BlockPool``.

It answers the scheduler (can this prompt be admitted, can every running
sequence grow) and keeps the books behind the answers: a prompt's blocks,
prefix-cache hits on computed full blocks, copy-on-write of shared blocks,
counters and an audit. No tensors: the pool that owns them copies blocks when
``append`` says so.

A hybrid model (Gemma 3) has several KV cache groups, one window each, and a
sequence one page table per group, all drawing on the one pool. A sliding
group frees the blocks that leave its window; their entries become the *null
block* (the tensors' last block: never handed out, written or counted).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from paged_core.block_pool import Block, BlockHash, BlockPool, hash_block_tokens, root_key
from paged_core.block_stats import BlockManagerStats
from paged_core.errors import OutOfBlocksError, UnknownSequenceError
from paged_core.kv_tiers import TierDirectory

__all__ = ["BlockManager"]

Copies = tuple[tuple[int, int, int], ...]  # (group, src, dst) blocks to copy


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _out_of_window(num_computed: int, window: int, block_size: int) -> int:
    """Leading blocks no later query sees once ``num_computed`` tokens are in:
    block ``i`` once ``(i + 1) * block_size <= num_computed - window + 1``."""
    return max(0, num_computed - window + 1) // block_size

# A plan's entry for a block the tiers restore into a fresh block (``allocate`` swaps it).
_TIER_HIT = Block(-1)

# Tokens per block unless configured (vLLM's default too): the one place it is written.
DEFAULT_BLOCK_SIZE = 16


@dataclass(slots=True)
class _SeqBlocks:
    tables: list[list[Block]]  # one page table per KV cache group, in token order
    tokens: list[int]  # ids of the tokens with room reserved (prompt + appended)
    num_computed: int = 0  # tokens whose KV is written
    hashes: list[BlockHash] = field(default_factory=list)  # keys of the leading full blocks
    root: BlockHash | None = None  # the first block's parent (root_key of its extra key)


class BlockManager:
    """Page tables, prefix caching, copy-on-write forks, counters and audits.

    ``sliding_windows[g]`` is group ``g``'s window in tokens (None: full
    attention); when one slides, the last of ``num_blocks`` is the null block."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int = DEFAULT_BLOCK_SIZE,
        enable_prefix_caching: bool = True,
        *,
        sliding_windows: Sequence[int | None] = (None,),
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if not sliding_windows or any(w is not None and w < 1 for w in sliding_windows):
            raise ValueError(f"need one window (None or >= 1) per group, got {sliding_windows}")
        self.windows = list(sliding_windows)
        self.num_groups, self._hybrid = len(self.windows), len(self.windows) > 1
        self._sliding: dict[int, list[int]] = {}  # window -> its groups
        for g, w in enumerate(self.windows):
            if w is not None:
                self._sliding.setdefault(w, []).append(g)
        if self._sliding and num_blocks < 1:
            raise ValueError("a pool with sliding-window groups needs a block for the null block")
        self.num_blocks = num_blocks - bool(self._sliding)
        self.block_pool = BlockPool(self.num_blocks)
        self.null_block = Block(self.num_blocks) if self._sliding else None  # outside the pool
        self.null_block_id = self.num_blocks if self._sliding else None
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._seqs: dict[int, _SeqBlocks] = {}
        self.counters = BlockManagerStats()  # stats() adds the occupancy
        # Host/disk tiers behind the prefix cache (one group only): see paged_core/kv_tiers.py.
        self.tiers: TierDirectory | None = None

    # -- admission -------------------------------------------------------
    def num_blocks_needed(
        self, token_ids: Sequence[int], *, skip_prefix_cache: bool = False,
        num_reserved: int | None = None, extra_key: bytes | None = None,
    ) -> int:  # fmt: skip
        """Free blocks ``allocate`` would take over every group: fresh ones plus
        prefix hits on free cached blocks (leaving the free queue uses capacity)."""
        return self._plan(token_ids, skip_prefix_cache, num_reserved, root_key(extra_key))[2]

    def can_allocate(
        self, token_ids: Sequence[int], *, skip_prefix_cache: bool = False,
        num_reserved: int | None = None, extra_key: bytes | None = None,
    ) -> bool:  # fmt: skip
        """Whether ``allocate`` would succeed now (exact, never optimistic)."""
        needed = self._plan(token_ids, skip_prefix_cache, num_reserved, root_key(extra_key))[2]
        return needed <= self.num_free_blocks()

    def allocate(
        self, seq_id: int, token_ids: Sequence[int], *,
        skip_prefix_cache: bool = False, num_reserved: int | None = None,
        extra_key: bytes | None = None,
    ) -> int:  # fmt: skip
        """Reserve a prompt's blocks in every group, reusing cached full blocks
        of its prefix. Returns how many prompt tokens are cached: whole blocks,
        never the last token, whose logits must be computed. With
        ``skip_prefix_cache`` nothing is looked up (to score every token) but
        what is computed is still registered. With ``num_reserved``, every
        token is looked up but room is reserved only for the first
        ``max(num_reserved, cached + 1)``; ``append`` reserves the rest as it is
        computed, so a sliding group holds no more than its window and the
        chunk in flight (a preempted sequence comes back this way). All or
        nothing. ``extra_key``: what else the KV depends on (a LoRA
        adapter): part of every block's key, so only an equal one hits."""
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id} already has blocks; free it before allocating")
        root = root_key(extra_key)
        tables, keys, needed, reserved = self._plan(token_ids, skip_prefix_cache, num_reserved, root)
        if needed > self.num_free_blocks():
            raise self._short(
                f"sequence {seq_id} needs {needed} free blocks for {reserved} tokens "
                f"({len(keys)} prefix-cache hit blocks)"
            )
        for table in tables:  # every hit before any fresh block, which could evict it
            self._acquire(table)
        fresh = _cdiv(reserved, self.block_size) - len(keys)
        for g, table in enumerate(tables):
            table += self.block_pool.get_new_blocks(fresh, g)
        if self.tiers is not None:
            self._restore_tier_hits(tables[0], keys, token_ids)
        seq = _SeqBlocks(tables, list(token_ids[:reserved]), len(keys) * self.block_size, keys, root)
        if self.enable_prefix_caching and not skip_prefix_cache:
            self._count_prompt(token_ids, keys, root)
        self._seqs[seq_id] = seq
        return seq.num_computed

    # -- growth ----------------------------------------------------------
    def can_append(self, seq_ids: Sequence[int], num_tokens: int = 1) -> bool:
        """Whether every listed sequence can grow by ``num_tokens`` now: new
        blocks at block boundaries plus private copies of shared last blocks,
        in every group. Exact: of several listed writers to one shared last
        block, the last to append keeps the original."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        bs, needed = self.block_size, 0
        shared_last: dict[Block, int] = {}  # a shared last block -> its writers here
        for seq_id in seq_ids:
            seq = self._seq(seq_id)
            n = len(seq.tokens)
            needed += (_cdiv(n + num_tokens, bs) - _cdiv(n, bs)) * self.num_groups
            for table in seq.tables if num_tokens and n % bs else ():
                if table[-1].ref_count > 1:
                    shared_last[table[-1]] = shared_last.get(table[-1], 0) + 1
        needed += sum(min(n, block.ref_count - 1) for block, n in shared_last.items())
        return needed <= self.num_free_blocks()

    def append(self, seq_id: int, token_id: int) -> Copies:
        """Reserve room for one more token in every group (``token_id`` is kept
        for prefix hashing): a new block at a block boundary, else a private
        copy of each shared last block, returned as ``(group, src, dst)`` for
        the pool to copy. ``OutOfBlocksError``, changing nothing, when short."""
        seq = self._seqs.get(seq_id) or self._seq(seq_id)  # get: the per-token hot path
        copies: Copies = ()
        if len(seq.tokens) % self.block_size == 0:
            if self.num_groups > len(self.block_pool.free_queue):
                raise self._short(f"sequence {seq_id} needs a new block for token {len(seq.tokens)}")
            for g, table in enumerate(seq.tables):
                table += self.block_pool.get_new_blocks(1, g)
        elif seq.tables[0][-1].ref_count > 1 or (
            self._hybrid and any(table[-1].ref_count > 1 for table in seq.tables)
        ):  # else (most tokens) the token fits the sequence's own last blocks
            copies = self._copy_shared_last(seq, seq_id)
        seq.tokens.append(token_id)
        return copies

    def set_token(self, seq_id: int, position: int, token_id: int) -> None:
        """The id of a token reserved before it was known (a step planned
        while the one sampling it ran), set before its block is hashed."""
        seq = self._seqs.get(seq_id) or self._seq(seq_id)
        if position < seq.num_computed:
            raise ValueError(
                f"sequence {seq_id}: token {position} is already computed (and may be hashed)"
            )
        seq.tokens[position] = token_id

    def mark_computed(self, seq_id: int, num_computed_tokens: int) -> bool:
        """Record that the first ``num_computed_tokens`` tokens' KV is written.
        Full blocks now computed enter the prefix index; sliding groups then free
        the blocks that left their window (returns whether any did; they stay cached)."""
        seq = self._seqs.get(seq_id) or self._seq(seq_id)
        if not 0 <= num_computed_tokens <= len(seq.tokens):
            raise ValueError(
                f"sequence {seq_id} has {len(seq.tokens)} tokens; cannot mark "
                f"{num_computed_tokens} as computed"
            )
        before, seq.num_computed = seq.num_computed, max(seq.num_computed, num_computed_tokens)
        bs = self.block_size
        while self.enable_prefix_caching and len(seq.hashes) < seq.num_computed // bs:
            i = len(seq.hashes)
            tokens = tuple(seq.tokens[i * bs : (i + 1) * bs])
            seq.hashes.append(hash_block_tokens(seq.hashes[-1] if seq.hashes else seq.root, tokens))
            for table in seq.tables:
                if table[i] is not self.null_block and (
                    self.block_pool.register(table[i], seq.hashes[-1], tokens) and self.tiers is not None
                ):
                    self.tiers.stored(seq.hashes[-1], tokens, table[i].block_id)
        return bool(self._sliding) and self._free_out_of_window(seq, before)

    # -- release ---------------------------------------------------------
    def free(self, seq_id: int) -> None:
        """Release a sequence's blocks (a preemption too), tail first so its tail
        is evicted before its head; cached content stays evictable."""
        seq = self._seq(seq_id)
        for g, table in enumerate(seq.tables):
            self.block_pool.free(reversed(table[self._released(g, seq.num_computed) :]))
        del self._seqs[seq_id]

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        """Forget the room reserved past the sequence's first ``num_tokens``
        tokens (a verify pass's rejected drafts): their ids go, and every
        block that holds none of the kept tokens is freed, tail first. The
        kept tokens must include every computed one."""
        seq = self._seq(seq_id)
        if not max(seq.num_computed, 1) <= num_tokens <= len(seq.tokens):
            raise ValueError(
                f"sequence {seq_id} computed {seq.num_computed} of {len(seq.tokens)} tokens; "
                f"cannot keep {num_tokens}"
            )
        keep = -(-num_tokens // self.block_size)
        for table in seq.tables:
            tail = table[keep:]
            del table[keep:]
            self.block_pool.free(reversed(tail))
        del seq.tokens[num_tokens:]

    def fork(self, parent: int, child: int) -> None:
        """Give ``child`` the tokens of ``parent`` by sharing every block
        (copy-on-write: the first write into a shared block copies it)."""
        if child in self._seqs:
            raise ValueError(f"cannot fork into sequence {child}: it already exists")
        src = self._seq(parent)
        for table in src.tables:
            self._acquire(table)
        tables = [list(t) for t in src.tables]
        self._seqs[child] = _SeqBlocks(tables, list(src.tokens), src.num_computed, list(src.hashes), src.root)
        self.counters.forks += 1

    # -- queries ---------------------------------------------------------
    def block_table(self, seq_id: int, group: int = 0, start: int = 0) -> list[int]:
        """Block ids of the sequence's ``group`` table from entry ``start`` on (a
        mirror reads what changed); released entries are the null block's id."""
        return [block.block_id for block in self._seq(seq_id).tables[group][start:]]

    def num_released(self, seq_id: int, group: int = 0) -> int:
        """Leading entries of the group's table freed as out of the window."""
        return self._released(group, self._seq(seq_id).num_computed)

    def num_tokens(self, seq_id: int) -> int:
        """Tokens reserved for the sequence (prompt + appended)."""
        return len((self._seqs.get(seq_id) or self._seq(seq_id)).tokens)  # get: per step

    def num_tokens_of(self, seq_ids: Sequence[int]) -> list[int]:
        """``num_tokens`` of each listed sequence in one call (a step's room check)."""
        seqs = self._seqs
        try:
            return [len(seqs[s].tokens) for s in seq_ids]
        except KeyError:
            return [self.num_tokens(s) for s in seq_ids]  # names the unknown one

    def num_computed_tokens(self, seq_id: int) -> int:
        """Tokens whose KV is written (prefix hits + ``mark_computed``)."""
        return self._seq(seq_id).num_computed

    def seq_ids(self) -> list[int]:
        """Live sequence ids, in allocation order."""
        return list(self._seqs)

    def num_free_blocks(self) -> int:
        """Free blocks, evictable cached ones included."""
        return len(self.block_pool.free_queue)

    def free_token_capacity(self) -> int:
        """Tokens the free blocks hold when every group stores them (a new
        prompt's do, until they leave a window)."""
        return self.num_free_blocks() * self.block_size // self.num_groups

    def group_blocks_used(self) -> list[int]:
        """Blocks each group holds (counted as they are taken and given back)."""
        return [self.block_pool.used_per_group.get(g, 0) for g in range(self.num_groups)]

    def stats(self) -> BlockManagerStats:
        """The counters with the pool's occupancy now."""
        c, free, n = self.counters, self.num_free_blocks(), self.num_blocks
        return replace(
            c, num_blocks=n, block_size=self.block_size, blocks_used=n - free, blocks_free=free,
            blocks_cached_free=self.block_pool.num_cached_free,
            tokens_used=sum(len(seq.tokens) for seq in self._seqs.values()),
            usage=(n - free) / n if n else 0.0,
            hit_rate=c.prefix_hits_tokens / max(1, c.prefix_queries_tokens),
            evictions=self.block_pool.evictions,
        )  # fmt: skip

    # -- health ----------------------------------------------------------
    def audit(self) -> list[str]:
        """Every inconsistency in the page tables (lengths, keys, released
        entries) and, through ``BlockPool.audit``, in the blocks they point at;
        empty when healthy. O(blocks + entries): for tests and health checks."""
        problems: list[str] = []
        bs = self.block_size
        for seq_id, seq in self._seqs.items():
            n, where = len(seq.tokens), f"sequence {seq_id}"
            if n < 1 or any(len(table) != _cdiv(n, bs) for table in seq.tables):
                problems.append(f"{where} has {n} tokens but {len(seq.tables[0])} blocks")
            if not 0 <= seq.num_computed <= n or len(seq.hashes) > n // bs:
                problems.append(f"{where} has {n} tokens but {seq.num_computed} computed, {len(seq.hashes)} keys")
            for g, table in enumerate(seq.tables):
                first = self._released(g, seq.num_computed)
                if any((block is self.null_block) != (i < first) for i, block in enumerate(table)):
                    problems.append(f"{where}: group {g}'s null entries are not its {first} released")
                for i, block in enumerate(table[first:], first):
                    own = tuple(seq.tokens[i * bs : (i + 1) * bs])
                    if block.block_hash is not None and (
                        (i < len(seq.hashes) and seq.hashes[i] != block.block_hash)
                        or (len(own) == bs and block.token_ids != own)
                    ):
                        problems.append(f"{where}: block {block.block_id} caches another prefix")
        if not self.enable_prefix_caching and self.block_pool.prefix_index:
            problems.append("prefix caching is off but the prefix index is not empty")
        return problems + self.block_pool.audit(self._live_tables(), bs)

    def reclaim_leaked(self) -> list[int]:
        """Free every block in use that no page table holds (a leak left by a
        bug elsewhere), dropping its cached content; returns their ids."""
        held = {block for table in self._live_tables() for block in table}
        leaked = [b for b in self.block_pool.blocks if b.ref_count and b not in held]
        for block in leaked:
            self.block_pool.reclaim(block)
        return [block.block_id for block in leaked]

    # -- internals -------------------------------------------------------
    def _live_tables(self) -> list[list[Block]]:
        """Every page table of every sequence, without the null block."""
        null = self.null_block
        return [[b for b in t if b is not null] for s in self._seqs.values() for t in s.tables]

    def _seq(self, seq_id: int) -> _SeqBlocks:
        if (seq := self._seqs.get(seq_id)) is None:
            raise UnknownSequenceError(
                f"unknown sequence {seq_id}: it was never allocated or is already freed"
            )
        return seq

    def _acquire(self, table: list[Block]) -> None:
        for block in table:
            if block is not self.null_block and block is not _TIER_HIT:
                self.block_pool.acquire(block)

    def _restore_tier_hits(self, table: list[Block], keys: list[BlockHash], token_ids: Sequence[int]) -> None:
        """Fresh blocks for the plan's tier hits, registered at once (their KV
        is restored before the next pass reads it: the tiers' ``load``)."""
        assert self.tiers is not None
        bs = self.block_size
        for i, key in enumerate(keys):
            if table[i] is _TIER_HIT:
                (block,) = self.block_pool.get_new_blocks(1, 0)
                self.block_pool.register(block, key, token_ids[i * bs : (i + 1) * bs])
                self.tiers.restore(key, block.block_id)
                table[i] = block

    def _copy_shared_last(self, seq: _SeqBlocks, seq_id: int) -> Copies:
        """Give ``seq`` a private copy of each last block it shares (copy-on-write)."""
        shared = [g for g, table in enumerate(seq.tables) if table[-1].ref_count > 1]
        if len(shared) > self.num_free_blocks():
            raise self._short(
                f"sequence {seq_id} needs a private copy of a shared block for token {len(seq.tokens)}"
            )
        copies = []
        for g in shared:
            last, (copy,) = seq.tables[g][-1], self.block_pool.get_new_blocks(1, g)
            self.block_pool.free([last])  # stays in use by the others
            seq.tables[g][-1] = copy
            copies.append((g, last.block_id, copy.block_id))
        self.counters.cow_copies += len(shared)
        return tuple(copies)

    def _short(self, need: str) -> OutOfBlocksError:
        """The error for a ``need`` the free blocks cannot meet (built only then)."""
        groups = f" (shared by {self.num_groups} KV cache groups)" if self._hybrid else ""
        return OutOfBlocksError(
            f"{need} but only {self.num_free_blocks()} of {self.num_blocks} are free{groups}; "
            "preempt a sequence or wait for one to finish"
        )

    def _free_out_of_window(self, seq: _SeqBlocks, before: int) -> bool:
        """Free the blocks that left a sliding window since ``before`` tokens
        were computed (the rule checked once per window); whether any did."""
        freed, bs = False, self.block_size
        for window, groups in self._sliding.items():
            first, dead = _out_of_window(before, window, bs), _out_of_window(seq.num_computed, window, bs)
            for g in groups if dead > first else ():
                self.block_pool.free(seq.tables[g][first:dead])
                seq.tables[g][first:dead] = [self.null_block] * (dead - first)  # type: ignore[list-item]
                freed = True
        return freed

    def _plan(
        self, token_ids: Sequence[int], skip_prefix_cache: bool, num_reserved: int | None = None,
        root: BlockHash | None = None,
    ) -> tuple[list[list[Block]], list[BlockHash], int, int]:
        """The prompt's prefix hit: per group, the blocks of its ``h`` leading
        full blocks (never the one holding the last prompt token); their keys;
        and the free blocks needed over all groups (fresh ones plus hits that
        are free now). A sliding group needs cached only the blocks a query
        after ``h`` blocks sees, the rest being the null block, so ``h`` stops
        where a full group misses, then drops a block at a time until every
        sliding group has its window cached. Last: the tokens to reserve."""
        if not (num_tokens := len(token_ids)):
            raise ValueError("a sequence needs at least 1 token, got no token ids")
        bs, windows, pool = self.block_size, self.windows, self.block_pool
        keys: list[BlockHash] = []
        found: list[list[Block | None]] = []  # per leading block: each group's cached one
        tiers = self.tiers
        lookup = self.enable_prefix_caching and not skip_prefix_cache and (pool.prefix_index or tiers)
        for i in range((num_tokens - 1) // bs if lookup else 0):
            tokens = token_ids[i * bs : (i + 1) * bs]
            key = hash_block_tokens(keys[-1] if keys else root, tokens)
            row = [pool.lookup(key, tokens, g) for g in range(len(windows))]
            if tiers is not None and row[0] is None and tiers.has(key, tokens):
                row = [_TIER_HIT]  # one group: the tiers refuse hybrid managers
            if None in row and any(b is None and w is None for b, w in zip(row, windows, strict=True)):
                break
            keys.append(key)
            found.append(row)
        h = len(keys)
        while h and any(None in [r[g] for r in found[self._released(g, h * bs) : h]] for g in range(len(windows))):
            h -= 1  # a sliding group misses a block its window needs
        tables: list[list[Block]] = []
        for g in range(len(windows)):
            first = self._released(g, h * bs)
            tables.append([self.null_block] * first + [found[i][g] for i in range(first, h)])  # type: ignore[arg-type]
        free_hits = sum(1 for t in tables for b in t if b is not self.null_block and b.ref_count == 0)
        reserved = num_tokens if num_reserved is None else min(num_tokens, max(num_reserved, h * bs + 1))
        return tables, keys[:h], (_cdiv(reserved, bs) - h) * len(windows) + free_hits, reserved

    def _count_prompt(
        self, token_ids: Sequence[int], keys: list[BlockHash], root: BlockHash | None = None
    ) -> None:
        """Count a prompt's hit blocks ``keys`` and why the rest missed (by
        group 0): a block whose key is cached or was evicted is "evicted" (it
        or its prefix went), else "never seen" (see ``BlockManagerStats``)."""
        c, bs, pool, num_tokens = self.counters, self.block_size, self.block_pool, len(token_ids)
        matchable = (num_tokens - 1) // bs
        c.prefix_queries_tokens += num_tokens
        c.prefix_hits_tokens += len(keys) * bs
        c.prefix_miss_too_short_tokens += num_tokens - matchable * bs
        parent = keys[-1] if keys else root
        for i in range(len(keys), matchable):
            parent = hash_block_tokens(parent, token_ids[i * bs : (i + 1) * bs])
            if (0, parent) in pool.prefix_index or (0, parent) in pool.evicted_keys:
                c.prefix_miss_evicted_tokens += bs
            else:
                c.prefix_miss_never_seen_tokens += bs

    def _released(self, group: int, num_computed: int) -> int:
        """Leading entries of ``group``'s tables that are the null block."""
        window = self.windows[group]
        return 0 if window is None else _out_of_window(num_computed, window, self.block_size)
