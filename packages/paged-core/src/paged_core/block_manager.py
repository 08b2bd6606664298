"""Block manager: per-sequence page tables over a ``BlockPool``.

It answers the scheduler's questions (can this prompt be admitted, can every
running sequence grow by one token) and does the bookkeeping behind them:
eager allocation of a prompt's blocks, prefix-cache hits on full blocks whose
KV is already computed, copy-on-write when a sequence writes into a block it
shares, and an audit; its counters are a ``PrefixCounters``. Pure Python, no tensors: the pool that owns the KV
tensors copies blocks when ``append`` says so. Preemptions are the engine's
to count (once, in the scheduler): here a preemption is a ``free``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from paged_core.block_pool import Block, BlockHash, BlockPool, hash_block_tokens
from paged_core.block_stats import BlockManagerStats, PrefixCounters
from paged_core.errors import OutOfBlocksError, UnknownSequenceError

__all__ = ["BlockManager", "check_prompt"]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def check_prompt(num_tokens: int, token_ids: Sequence[int] | None) -> None:
    """A prompt has at least one token, and ``num_tokens`` ids when ids are given."""
    if num_tokens <= 0:
        raise ValueError(f"a sequence needs at least 1 token, got num_tokens={num_tokens}")
    if token_ids is not None and len(token_ids) != num_tokens:
        raise ValueError(f"num_tokens is {num_tokens} but {len(token_ids)} token ids were given")


@dataclass(slots=True)
class _SeqBlocks:
    """One sequence's page table and what prefix caching needs to know of it."""

    table: list[Block]
    num_tokens: int  # reserved: prompt + appended
    num_computed: int = 0  # tokens whose KV the pool reported written
    tokens: list[int] = field(default_factory=list)  # known ids; stop growing at the first unknown
    hashes: list[BlockHash] = field(default_factory=list)  # chained keys of leading full blocks
    num_released: int = 0  # leading entries that are the null block (out of a sliding window)


class BlockManager:
    """Page tables, prefix caching, copy-on-write forks, audits and counters."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        *,
        block_pool: BlockPool | None = None,
        sliding_window: int | None = None,
        null_block: Block | None = None,
        hash_salt: BlockHash | None = None,
        group: int = 0,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if sliding_window is not None and null_block is None:
            raise ValueError("a sliding-window block manager needs a null_block for freed entries")
        # One KV cache group of several share block_pool (see KVCacheCoordinator):
        # out-of-window entries become null_block; keys chain from hash_salt;
        # the pool counts blocks in use per group; group 0 counts the prompts.
        self.block_pool = block_pool if block_pool is not None else BlockPool(num_blocks)
        self.sliding_window, self.null_block = sliding_window, null_block
        self.hash_salt, self.group = hash_salt, group
        self.num_blocks = len(self.block_pool.blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._seqs: dict[int, _SeqBlocks] = {}
        self.counters = PrefixCounters()

    # -- admission -------------------------------------------------------
    def num_blocks_needed(
        self,
        num_tokens: int,
        token_ids: Sequence[int] | None = None,
        *,
        skip_prefix_cache: bool = False,
    ) -> int:
        """Free blocks that ``allocate`` would take for this prompt: fresh blocks
        beyond the prefix hits, plus hits on cached blocks that are currently
        free (taking them out of the free queue uses up free capacity too)."""
        return self._plan(num_tokens, token_ids, skip_prefix_cache)[1]

    def can_allocate(
        self,
        num_tokens: int,
        token_ids: Sequence[int] | None = None,
        *,
        skip_prefix_cache: bool = False,
    ) -> bool:
        """Whether ``allocate`` would succeed now (exact, never optimistic)."""
        needed = self.num_blocks_needed(num_tokens, token_ids, skip_prefix_cache=skip_prefix_cache)
        return needed <= self.num_free_blocks()

    def allocate(
        self,
        seq_id: int,
        num_tokens: int,
        token_ids: Sequence[int] | None = None,
        *,
        skip_prefix_cache: bool = False,
        hits: list[tuple[Block, BlockHash]] | None = None,
    ) -> int:
        """Reserve blocks for a prompt of ``num_tokens`` tokens, reusing cached
        full blocks of its prefix. Returns the number of prompt tokens whose KV
        is already cached (a multiple of ``block_size``; never the whole prompt,
        because the last prompt token must be computed to get logits).
        ``skip_prefix_cache`` looks nothing up (every prompt token is computed,
        e.g. to score it) but still registers the blocks it computes.

        ``hits`` (the coordinator's) replaces this manager's own lookup.

        All or nothing: ``OutOfBlocksError`` leaves no state behind."""
        if seq_id in self._seqs:
            raise ValueError(
                f"sequence {seq_id} already has blocks; free it before allocating again"
            )
        hits, needed = self._plan(num_tokens, token_ids, skip_prefix_cache, hits)
        if needed > self.num_free_blocks():
            raise OutOfBlocksError(
                f"sequence {seq_id} needs {needed} free blocks for {num_tokens} tokens "
                f"({len(hits)} prefix-cache hit blocks) but only {self.num_free_blocks()} of "
                f"{self.num_blocks} are free; wait for sequences to finish or preempt one"
            )
        table = [block for block, _ in hits]
        released = sum(1 for block in table if block is self.null_block)
        for block in table[released:]:
            self.block_pool.acquire(block)
        table += self.block_pool.get_new_blocks(
            _cdiv(num_tokens, self.block_size) - len(hits), self.group
        )
        num_cached = len(hits) * self.block_size
        seq = _SeqBlocks(table, num_tokens, num_cached, num_released=released)
        if self.enable_prefix_caching:
            seq.hashes = [block_hash for _, block_hash in hits]
            seq.tokens = list(token_ids) if token_ids is not None else []
            if not skip_prefix_cache and self.group == 0:
                last_hit = hits[-1][1] if hits else self.hash_salt
                self.counters.count_prompt(
                    self.block_pool, self.block_size, num_tokens, token_ids, len(hits), last_hit
                )
        self._seqs[seq_id] = seq
        return num_cached

    # -- growth ----------------------------------------------------------
    def can_append(self, seq_ids: Sequence[int], num_tokens: int = 1) -> bool:
        """Whether every sequence in ``seq_ids`` can grow by ``num_tokens`` now:
        new blocks at block boundaries plus private copies of shared last
        blocks. Exact: when several of the listed sequences share one last
        block, the last of them to append keeps the original."""
        return self.num_blocks_to_append(seq_ids, num_tokens) <= self.num_free_blocks()

    def num_blocks_to_append(self, seq_ids: Sequence[int], num_tokens: int = 1) -> int:
        """Free blocks ``can_append`` asks for (see there)."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        bs = self.block_size
        needed = 0
        shared_last: dict[Block, int] = {}  # a shared last block -> its writers here
        for seq_id in seq_ids:
            seq = self._seq(seq_id)
            n = seq.num_tokens
            needed += _cdiv(n + num_tokens, bs) - _cdiv(n, bs)
            if num_tokens and n % bs and seq.table[-1].ref_count > 1:
                shared_last[seq.table[-1]] = shared_last.get(seq.table[-1], 0) + 1
        for block, writers in shared_last.items():
            needed += min(writers, block.ref_count - 1)
        return needed

    def blocks_to_append(self, seq_id: int) -> int:
        """Free blocks ``append`` takes now: 1 at a block boundary or for a
        copy of a shared last block, else 0."""
        seq = self._seq(seq_id)
        return int(seq.num_tokens % self.block_size == 0 or seq.table[-1].ref_count > 1)

    def append(self, seq_id: int, token_id: int | None = None) -> list[tuple[int, int]]:
        """Reserve room for one more token (``token_id`` is recorded for prefix
        hashing). Takes a new block at a block boundary. If the token lands in
        a block other sequences share, the sequence first gets a private copy:
        the returned ``(src, dst)`` pair tells the pool which block to copy.

        ``OutOfBlocksError`` (no state change) when a block is needed and none
        is free."""
        seq = self._seq(seq_id)
        copies: list[tuple[int, int]] = []
        if seq.num_tokens % self.block_size == 0:
            self._require_free(f"sequence {seq_id} needs a new block for token {seq.num_tokens}")
            seq.table += self.block_pool.get_new_blocks(1, self.group)
        elif (last := seq.table[-1]).ref_count > 1:
            self._require_free(
                f"sequence {seq_id} needs a private copy of shared block {last.block_id}"
            )
            (copy,) = self.block_pool.get_new_blocks(1, self.group)
            self.block_pool.free([last])  # stays in use by the others
            seq.table[-1] = copy
            copies.append((last.block_id, copy.block_id))
            self.counters.cow_copies += 1
        if (
            self.enable_prefix_caching
            and token_id is not None
            and len(seq.tokens) == seq.num_tokens
        ):
            seq.tokens.append(token_id)  # ids are kept while every id so far is known
        seq.num_tokens += 1
        return copies

    def mark_computed(self, seq_id: int, num_computed_tokens: int) -> bool:
        """Record that the KV of the first ``num_computed_tokens`` tokens is
        written. Full blocks that are now computed (and whose tokens are all
        known) enter the prefix index; only then can other prompts hit them.
        With a sliding window, blocks no later query can see are freed then
        (returns whether any were)."""
        seq = self._seq(seq_id)
        if not 0 <= num_computed_tokens <= seq.num_tokens:
            raise ValueError(
                f"sequence {seq_id} has {seq.num_tokens} tokens; cannot mark "
                f"{num_computed_tokens} as computed"
            )
        seq.num_computed = max(seq.num_computed, num_computed_tokens)
        bs = self.block_size
        num_hashable = min(seq.num_computed, len(seq.tokens)) // bs
        while self.enable_prefix_caching and len(seq.hashes) < num_hashable:
            i = len(seq.hashes)
            tokens = seq.tokens[i * bs : (i + 1) * bs]
            block_hash = hash_block_tokens(seq.hashes[-1] if seq.hashes else self.hash_salt, tokens)
            seq.hashes.append(block_hash)
            if i >= seq.num_released:
                self.block_pool.register(seq.table[i], block_hash, tokens)
        if self.sliding_window is not None:  # after registering: freed blocks stay cached
            dead = max(0, seq.num_computed - self.sliding_window + 1) // bs
            if dead > seq.num_released:
                self.block_pool.free(seq.table[seq.num_released : dead])
                seq.table[seq.num_released : dead] = [self.null_block] * (dead - seq.num_released)  # type: ignore[list-item]
                seq.num_released = dead
                return True
        return False

    def num_released(self, seq_id: int) -> int:
        """Leading page-table entries freed as out of the window (null block)."""
        return self._seq(seq_id).num_released

    # -- release ---------------------------------------------------------
    def free(self, seq_id: int) -> None:
        """Release a sequence's blocks, tail first, so that its tail is evicted
        before its head. Blocks with cached content stay evictable."""
        seq = self._seq(seq_id)
        self.block_pool.free(reversed(seq.table[seq.num_released :]))
        del self._seqs[seq_id]

    def fork(self, parent: int, child: int) -> None:
        """Give ``child`` the same tokens as ``parent`` by sharing every block
        (copy-on-write: the first write into a shared block copies it)."""
        if child in self._seqs:
            raise ValueError(f"cannot fork into sequence {child}: it already exists")
        src = self._seq(parent)
        for block in src.table[src.num_released :]:
            self.block_pool.acquire(block)
        self._seqs[child] = _SeqBlocks(
            list(src.table), src.num_tokens, src.num_computed,
            list(src.tokens), list(src.hashes), src.num_released,
        )  # fmt: skip
        self.counters.forks += 1

    # -- queries ---------------------------------------------------------
    def block_table(self, seq_id: int) -> list[int]:
        """The sequence's block ids in token order."""
        return [block.block_id for block in self._seq(seq_id).table]

    def blocks_from(self, seq_id: int, start: int) -> list[int]:
        """The sequence's block ids from index ``start`` on: what changed since
        a caller that mirrors the table last looked (O(new blocks))."""
        return [block.block_id for block in self._seq(seq_id).table[start:]]

    def num_tokens(self, seq_id: int) -> int:
        """Tokens reserved for the sequence (prompt + appended)."""
        return self._seq(seq_id).num_tokens

    def num_computed_tokens(self, seq_id: int) -> int:
        """Tokens whose KV is written (prefix hits + ``mark_computed``)."""
        return self._seq(seq_id).num_computed

    def has_seq(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def seq_ids(self) -> list[int]:
        """Live sequence ids, in allocation order."""
        return list(self._seqs)

    def num_free_blocks(self) -> int:
        """Free blocks, including evictable ones that still hold cached content."""
        return len(self.block_pool.free_queue)

    def free_token_capacity(self) -> int:
        """Tokens the free blocks can hold."""
        return self.num_free_blocks() * self.block_size

    def stats(self) -> BlockManagerStats:
        """Operator counters (see ``BlockManagerStats``)."""
        tokens_used = sum(seq.num_tokens for seq in self._seqs.values())
        return self.counters.snapshot(self.block_pool, self.block_size, tokens_used)

    # -- health ----------------------------------------------------------
    def audit(self) -> list[str]:
        """Every inconsistency between the page tables and the blocks they point
        at (each sequence's lengths and prefix keys here; ref counts, the free
        queue and the prefix index in ``BlockPool.audit``); empty when healthy.
        O(num_blocks + total table length): for tests and health checks."""
        return self.audit_tables() + self.block_pool.audit(self.live_tables(), self.block_size)

    def live_tables(self) -> list[list[Block]]:
        """Each sequence's page table without its released (null) entries."""
        return [s.table[s.num_released :] for s in self._seqs.values()]

    def audit_tables(self) -> list[str]:
        """``audit`` without the pool's side: lengths, keys, released entries."""
        problems: list[str] = []
        bs = self.block_size
        for seq_id, seq in self._seqs.items():
            n, where = seq.num_tokens, f"sequence {seq_id}"
            if n < 1 or len(seq.table) != _cdiv(n, bs):
                problems.append(f"{where} has {n} tokens but {len(seq.table)} blocks")
            if not 0 <= seq.num_computed <= n or len(seq.tokens) > n or len(seq.hashes) > n // bs:
                problems.append(
                    f"{where} has {n} tokens but {seq.num_computed} computed, "
                    f"{len(seq.tokens)} token ids, {len(seq.hashes)} block keys"
                )
            if any(b is not self.null_block for b in seq.table[: seq.num_released]):
                problems.append(f"{where}: a released page-table entry is not the null block")
            for i, block in enumerate(seq.table):
                if block.block_hash is None:
                    continue
                own = tuple(seq.tokens[i * bs : (i + 1) * bs])
                if (i < len(seq.hashes) and seq.hashes[i] != block.block_hash) or (
                    len(own) == bs and block.token_ids != own
                ):
                    problems.append(f"{where}: block {block.block_id} caches another prefix")
        if not self.enable_prefix_caching and self.block_pool.prefix_index:
            problems.append("prefix caching is off but the prefix index is not empty")
        return problems

    def reclaim_leaked(self) -> list[int]:
        """Free every block in use that no page table points at (a leak left by
        a bug elsewhere) and drop its cached content. Returns their ids."""
        held = {block.block_id for seq in self._seqs.values() for block in seq.table}
        leaked = [b for b in self.block_pool.blocks if b.ref_count and b.block_id not in held]
        for block in leaked:
            self.block_pool.reclaim(block)
        return [block.block_id for block in leaked]

    # -- internals -------------------------------------------------------
    def _seq(self, seq_id: int) -> _SeqBlocks:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise UnknownSequenceError(
                f"unknown sequence {seq_id}: it was never allocated or is already freed"
            )
        return seq

    def _plan(
        self,
        num_tokens: int,
        token_ids: Sequence[int] | None,
        skip_prefix_cache: bool = False,
        given: list[tuple[Block, BlockHash]] | None = None,
    ) -> tuple[list[tuple[Block, BlockHash]], int]:
        """The prompt's leading full blocks found in the prefix index, with
        their keys (up to the first miss; never the block holding the last
        prompt token, whose logits must be computed), and the free blocks the
        prompt needs: fresh ones plus hits that are free now."""
        check_prompt(num_tokens, token_ids)
        bs = self.block_size
        hits: list[tuple[Block, BlockHash]] = [] if given is None else given
        parent = self.hash_salt
        lookup = self.enable_prefix_caching and not skip_prefix_cache and given is None
        if lookup and token_ids is not None and self.block_pool.prefix_index:
            for i in range((num_tokens - 1) // bs):
                tokens = token_ids[i * bs : (i + 1) * bs]
                parent = hash_block_tokens(parent, tokens)
                block = self.block_pool.lookup(parent, tokens)
                if block is None:
                    break
                hits.append((block, parent))
        free_hits = sum(1 for b, _ in hits if b.ref_count == 0 and b is not self.null_block)
        return hits, _cdiv(num_tokens, bs) - len(hits) + free_hits

    def _require_free(self, why: str) -> None:
        if not self.block_pool.free_queue:
            raise OutOfBlocksError(
                f"{why} but only 0 of {self.num_blocks} blocks are free; preempt a sequence first"
            )
