"""Block manager: per-sequence page tables over a ref-counted block pool.

It answers the scheduler's questions (can this prompt be admitted, can every
running sequence grow by one token) and does the bookkeeping behind them:
eager allocation of a prompt's blocks, prefix-cache hits on full blocks whose
KV is already computed, copy-on-write when a sequence writes into a block it
shares, and audits that cross-check every structure. Pure Python, no tensors:
the pool that owns the KV tensors copies blocks when ``append`` says so.

Which free block is reused next (plain ones first, then cached ones least
recently freed first) is ``BlockPool``'s job; the block manager knows sequences.
"""

from __future__ import annotations

from collections.abc import Sequence

from paged_core.block_manager_audit import audit_block_manager
from paged_core.block_manager_stats import BlockManagerStats
from paged_core.block_pool import BlockPool
from paged_core.errors import OutOfBlocksError
from paged_core.prefix_cache import BlockHash, hash_block_tokens
from paged_core.sequence_blocks import SequenceBlocks, UnknownSequenceError

__all__ = ["BlockManager", "UnknownSequenceError"]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    """Page tables, prefix caching, copy-on-write forks, audits and counters."""

    def __init__(
        self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_blocks)
        self.allocator = self.block_pool.allocator
        self._seqs: dict[int, SequenceBlocks] = {}
        self._tokens_used = 0
        self._prefix_queries_tokens = 0
        self._prefix_hits_tokens = 0
        self._forks = 0
        self._cow_copies = 0
        self._preemptions = 0

    # -- admission -------------------------------------------------------
    def num_blocks_needed(self, num_tokens: int, token_ids: Sequence[int] | None = None) -> int:
        """Free blocks that ``allocate`` would take for this prompt: fresh blocks
        beyond the prefix hits, plus hits on cached blocks that are currently
        free (taking them out of the free list uses up free capacity too)."""
        self._check_prompt(num_tokens, token_ids)
        hits = self._match_prefix(num_tokens, token_ids)
        free_hits = sum(1 for block_id, _ in hits if self.allocator.is_free(block_id))
        return _cdiv(num_tokens, self.block_size) - len(hits) + free_hits

    def can_allocate(self, num_tokens: int, token_ids: Sequence[int] | None = None) -> bool:
        """Whether ``allocate`` would succeed now (exact, never optimistic)."""
        return self.num_blocks_needed(num_tokens, token_ids) <= self.allocator.num_free()

    def allocate(self, seq_id: int, num_tokens: int, token_ids: Sequence[int] | None = None) -> int:
        """Reserve blocks for a prompt of ``num_tokens`` tokens, reusing cached
        full blocks of its prefix. Returns the number of prompt tokens whose KV
        is already cached (a multiple of ``block_size``; never the whole prompt,
        because the last prompt token must be computed to get logits).

        All or nothing: ``OutOfBlocksError`` leaves no state behind."""
        if seq_id in self._seqs:
            raise ValueError(
                f"sequence {seq_id} already has blocks; free it before allocating again"
            )
        self._check_prompt(num_tokens, token_ids)
        hits = self._match_prefix(num_tokens, token_ids)
        num_fresh = _cdiv(num_tokens, self.block_size) - len(hits)
        needed = num_fresh + sum(1 for block_id, _ in hits if self.allocator.is_free(block_id))
        if needed > self.allocator.num_free():
            raise OutOfBlocksError(
                f"sequence {seq_id} needs {needed} free blocks for {num_tokens} tokens "
                f"({len(hits)} prefix-cache hit blocks) but only {self.allocator.num_free()} of "
                f"{self.num_blocks} are free; wait for sequences to finish or preempt one"
            )
        table = []
        for block_id, _ in hits:
            self.block_pool.acquire_hit(block_id, owner=seq_id)
            table.append(block_id)
        table.extend(self.block_pool.allocate_fresh(num_fresh, seq_id))

        num_cached = len(hits) * self.block_size
        seq = SequenceBlocks(table=table, num_tokens=num_tokens, num_computed=num_cached)
        if self.enable_prefix_caching:
            seq.hashes = [block_hash for _, block_hash in hits]
            if token_ids is None:
                seq.tokens_complete = False
            else:
                seq.tokens = list(token_ids)
            self._prefix_queries_tokens += num_tokens
            self._prefix_hits_tokens += num_cached
        self._seqs[seq_id] = seq
        self._tokens_used += num_tokens
        return num_cached

    # -- growth ----------------------------------------------------------
    def can_append(self, seq_ids: Sequence[int], num_tokens: int = 1) -> bool:
        """Whether every sequence in ``seq_ids`` can grow by ``num_tokens`` now:
        new blocks at block boundaries plus private copies of shared last
        blocks. Exact: when several of the listed sequences share one last
        block, the last of them to append keeps the original."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        bs = self.block_size
        needed = 0
        shared_last: dict[int, int] = {}
        for seq_id in seq_ids:
            seq = self._seq(seq_id)
            n = seq.num_tokens
            needed += _cdiv(n + num_tokens, bs) - _cdiv(n, bs)
            if num_tokens and n % bs:
                last = seq.table[-1]
                if self.allocator.ref_count(last) > 1:
                    shared_last[last] = shared_last.get(last, 0) + 1
        for block_id, writers in shared_last.items():
            needed += min(writers, self.allocator.ref_count(block_id) - 1)
        return needed <= self.allocator.num_free()

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
            self._require_free(1, f"sequence {seq_id} needs a new block for token {seq.num_tokens}")
            seq.table.extend(self.block_pool.allocate_fresh(1, seq_id))
        else:
            last = seq.table[-1]
            if self.allocator.ref_count(last) > 1:
                self._require_free(
                    1, f"sequence {seq_id} needs a private copy of shared block {last}"
                )
                (copy,) = self.block_pool.allocate_fresh(1, seq_id)
                self.block_pool.release([last], owner=seq_id)  # stays in use by the others
                seq.table[-1] = copy
                copies.append((last, copy))
                self._cow_copies += 1
        seq.num_tokens += 1
        self._tokens_used += 1
        if self.enable_prefix_caching and seq.tokens_complete:
            if token_id is None:
                seq.tokens_complete = False
            else:
                seq.tokens.append(token_id)
        return copies

    def mark_computed(self, seq_id: int, num_computed_tokens: int) -> None:
        """Record that the KV of the first ``num_computed_tokens`` tokens is
        written. Full blocks that are now computed (and whose tokens are all
        known) enter the prefix index; only then can other prompts hit them."""
        seq = self._seq(seq_id)
        if not 0 <= num_computed_tokens <= seq.num_tokens:
            raise ValueError(
                f"sequence {seq_id} has {seq.num_tokens} tokens; cannot mark "
                f"{num_computed_tokens} as computed"
            )
        seq.num_computed = max(seq.num_computed, num_computed_tokens)
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_hashable = min(seq.num_computed, len(seq.tokens)) // bs
        while len(seq.hashes) < num_hashable:
            i = len(seq.hashes)
            tokens = seq.tokens[i * bs : (i + 1) * bs]
            block_hash = hash_block_tokens(seq.hashes[-1] if seq.hashes else None, tokens)
            seq.hashes.append(block_hash)
            self.block_pool.cache.register(seq.table[i], block_hash, tokens)

    # -- release ---------------------------------------------------------
    def free(self, seq_id: int) -> None:
        """Release a sequence's blocks, tail first, so that its tail is evicted
        before its head. Blocks with cached content stay evictable."""
        seq = self._seq(seq_id)
        self.block_pool.release(reversed(seq.table), owner=seq_id)
        del self._seqs[seq_id]
        self._tokens_used -= seq.num_tokens

    def fork(self, parent: int, child: int) -> None:
        """Give ``child`` the same tokens as ``parent`` by sharing every block
        (copy-on-write: the first write into a shared block copies it)."""
        if child in self._seqs:
            raise ValueError(f"cannot fork into sequence {child}: it already exists")
        src = self._seq(parent)
        for block_id in src.table:
            self.allocator.share(block_id, owner=child)
        self._seqs[child] = src.copy()
        self._tokens_used += src.num_tokens
        self._forks += 1

    def preempt(self, seq_id: int) -> int:
        """Free a sequence to make room; returns how many tokens it held, which
        must be recomputed when it is readmitted (less any prefix hits then)."""
        num_tokens = self._seq(seq_id).num_tokens
        self.free(seq_id)
        self._preemptions += 1
        return num_tokens

    # -- queries ---------------------------------------------------------
    def block_table(self, seq_id: int) -> list[int]:
        """The sequence's block ids in token order (a copy)."""
        return list(self._seq(seq_id).table)

    def blocks_from(self, seq_id: int, start: int) -> list[int]:
        """The sequence's block ids from index ``start`` on: what changed since
        a caller that mirrors the table last looked (O(new blocks))."""
        return self._seq(seq_id).table[start:]

    def seq_lens(self, seq_ids: Sequence[int]) -> list[int]:
        """``seq_len`` of each sequence, in one call (a step checks its batch)."""
        seqs = self._seqs
        try:
            return [seqs[s].num_tokens for s in seq_ids]
        except KeyError as exc:
            raise UnknownSequenceError(
                f"unknown sequence {exc.args[0]}: it was never allocated or is already freed"
            ) from None

    def seq_len(self, seq_id: int) -> int:
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
        return self.allocator.num_free()

    def free_token_capacity(self) -> int:
        """Tokens the free blocks can hold."""
        return self.allocator.num_free() * self.block_size

    def stats(self) -> BlockManagerStats:
        """Operator counters (see ``BlockManagerStats``)."""
        free = self.allocator.num_free()
        used = self.num_blocks - free
        queries = self._prefix_queries_tokens
        return BlockManagerStats(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            blocks_used=used,
            blocks_free=free,
            blocks_cached_free=self.block_pool.num_cached_free(),
            tokens_used=self._tokens_used,
            tokens_capacity_free=free * self.block_size,
            usage=used / self.num_blocks if self.num_blocks else 0.0,
            prefix_queries_tokens=queries,
            prefix_hits_tokens=self._prefix_hits_tokens,
            hit_rate=self._prefix_hits_tokens / queries if queries else 0.0,
            evictions=self.block_pool.evictions,
            forks=self._forks,
            cow_copies=self._cow_copies,
            preemptions=self._preemptions,
        )

    # -- health ----------------------------------------------------------
    def audit(self) -> list[str]:
        """Cross-check allocator, ref counts, page tables, free lists and the
        prefix index. Returns every inconsistency found (empty when healthy).
        O(num_blocks + total table length): for tests and health checks."""
        return audit_block_manager(self)

    def reclaim_leaked(self) -> list[int]:
        """Free every allocated block that no page table points at (a leak
        left by a bug elsewhere) and drop its cached content. Returns them."""
        referenced = [b for seq in self._seqs.values() for b in seq.table]
        leaked = self.allocator.find_unreferenced_blocks(referenced)
        for block_id in leaked:
            self.block_pool.reclaim(block_id)
        return leaked

    # -- internals -------------------------------------------------------
    def _seq(self, seq_id: int) -> SequenceBlocks:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise UnknownSequenceError(
                f"unknown sequence {seq_id}: it was never allocated or is already freed"
            )
        return seq

    def _check_prompt(self, num_tokens: int, token_ids: Sequence[int] | None) -> None:
        if num_tokens <= 0:
            raise ValueError(f"a sequence needs at least 1 token, got num_tokens={num_tokens}")
        if token_ids is not None and len(token_ids) != num_tokens:
            raise ValueError(
                f"num_tokens is {num_tokens} but {len(token_ids)} token ids were given"
            )

    def _match_prefix(
        self, num_tokens: int, token_ids: Sequence[int] | None
    ) -> list[tuple[int, BlockHash]]:
        """Leading full blocks of the prompt found in the prefix index, as
        ``(block_id, key)``; stops at the first miss. The block holding the
        last prompt token is never matched: its logits must be computed."""
        if not self.enable_prefix_caching or token_ids is None or not len(self.block_pool.cache):
            return []
        bs = self.block_size
        hits: list[tuple[int, BlockHash]] = []
        parent: BlockHash | None = None
        for i in range((num_tokens - 1) // bs):
            tokens = token_ids[i * bs : (i + 1) * bs]
            parent = hash_block_tokens(parent, tokens)
            block_id = self.block_pool.cache.lookup(parent, tokens)
            if block_id is None:
                break
            hits.append((block_id, parent))
        return hits

    def _require_free(self, n: int, why: str) -> None:
        if n > self.allocator.num_free():
            raise OutOfBlocksError(
                f"{why} but only {self.allocator.num_free()} of {self.num_blocks} blocks are "
                "free; preempt a sequence first"
            )
