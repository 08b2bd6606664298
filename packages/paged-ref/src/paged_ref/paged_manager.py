"""The scheduler's side of a block-paged KV cache: which blocks each sequence holds.

``PagedKVManager`` owns the ``BlockManager`` (block ids, ref counts, the
prefix cache, copy-on-write forks, sliding-window freeing, counters, the
audit) and mirrors its page tables into host tensors (``BlockTableBuffer``,
one per KV cache group), so each step's ``StepLayout`` is one gather of the
batch's rows. Block copies that copy-on-write asks for are kept until the
next layout, which carries them to the workers. It holds no KV tensor: the
workers' ``KVCacheTensors`` do, built from the same ``KVCacheSpec``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from paged_core.block_manager import BlockManager
from paged_core.errors import OutOfBlocksError
from paged_ref.block_table_buffer import BlockTableBuffer
from paged_ref.seed_views import UNKNOWN_TOKEN
from paged_ref.step_layout import StepLayout


class PagedKVManager:
    """Page tables over ``num_blocks`` blocks (the null block included when
    a group slides, see ``BlockManager``); satisfies ``KVCacheManagerProtocol``."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        sliding_windows: Sequence[int | None] = (None,),
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.windows = list(sliding_windows)
        # The block manager reserves the last block as the null block when a group slides.
        self.block_manager = BlockManager(
            num_blocks, block_size, enable_prefix_caching, sliding_windows=self.windows
        )
        self._null = self.block_manager.null_block_id
        self._tables = [BlockTableBuffer() for _ in self.windows]
        self._released = [dict[int, int]() for _ in self.windows]  # mirrored null entries
        self._pending_copies: list[tuple[int, int]] = []
        self._next_seq_id = 0

    def is_paged(self) -> bool:
        return True

    # -- capacity ------------------------------------------------------------
    def free_seq(self, seq_id: int) -> None:
        """Release the seq_id's blocks (prefix-cached ones stay evictable)."""
        self.block_manager.free(seq_id)
        for tables, released in zip(self._tables, self._released, strict=True):
            tables.remove(seq_id)
            released.pop(seq_id, None)

    def get_num_computed_tokens(self, seq_id: int) -> int:
        """Tokens whose KV is in the cache (prefix hits included)."""
        return self.block_manager.num_computed_tokens(seq_id)

    def free_seq_count(self) -> int:
        """Free blocks: a bound on how many more sequences fit."""
        return self.block_manager.num_free_blocks()

    def free_token_capacity(self) -> int:
        return self.block_manager.free_token_capacity()

    def can_allocate_sequence(
        self, token_ids: Sequence[int], *, skip_prefix_cache: bool = False,
        num_reserved: int | None = None, extra_key: bytes | None = None,
    ) -> bool:  # fmt: skip
        return self.can_allocate_sequences(
            [token_ids], skip_prefix_cache=skip_prefix_cache, num_reserved=num_reserved,
            extra_key=extra_key,
        )

    def can_allocate_sequences(
        self, token_ids: Sequence[Sequence[int]], *, skip_prefix_cache: bool = False,
        num_reserved: int | None = None, extra_key: bytes | None = None,
    ) -> bool:  # fmt: skip
        """Whether all of them fit at once (hits on the same free cached block
        are counted once per sequence: never optimistic)."""
        bm = self.block_manager
        if not all(token_ids):
            return False
        needed = sum(
            bm.num_blocks_needed(
                t, skip_prefix_cache=skip_prefix_cache, num_reserved=num_reserved, extra_key=extra_key
            )
            for t in token_ids
        )
        return needed <= bm.num_free_blocks()

    def allocate_sequence(
        self, token_ids: Sequence[int], *, skip_prefix_cache: bool = False,
        num_reserved: int | None = None, extra_key: bytes | None = None,
    ) -> tuple[int, int]:  # fmt: skip
        """A seq_id for the prompt; returns ``(seq_id, num_cached_tokens)`` where the
        first ``num_cached_tokens`` come from the prefix cache. With
        ``num_reserved`` only that many tokens (at least the hit + 1) get room
        now; ``append_token`` reserves the rest. ``extra_key``: what else
        its KV depends on (a LoRA adapter's name): hits need the same one."""
        seq_id = self._new_seq_id()
        cached = self.block_manager.allocate(
            seq_id, token_ids, skip_prefix_cache=skip_prefix_cache, num_reserved=num_reserved,
            extra_key=extra_key,
        )
        self._sync_table(seq_id)
        return seq_id, cached

    def can_append(self, seq_ids: Sequence[int]) -> bool:
        """Whether every seq_id can grow by one token right now (exact)."""
        return self.block_manager.can_append(seq_ids)

    def append_token(self, seq_id: int, token_id: int) -> None:
        """Reserve room for ``token_id``. If its block is shared, the seq_id gets
        a private copy, made before the next step reads or writes the cache."""
        self._append(seq_id, token_id, self.block_manager.num_tokens(seq_id))

    def get_num_reserved(self, seq_id: int) -> int:
        """Tokens the seq_id has room for (committed + reserved ahead)."""
        return self.block_manager.num_tokens(seq_id)

    def reserve(self, seq_id: int, token_ids: Sequence[int], upto: int) -> int:
        """``append_token`` for ``token_ids[reserved:upto]`` while blocks last;
        returns how many tokens have room (``< upto``: out of blocks). Past
        the end of ``token_ids`` (a token still being sampled) the id is
        ``UNKNOWN_TOKEN`` until ``set_token`` gives it."""
        reserved = self.block_manager.num_tokens(seq_id)
        known = len(token_ids)
        try:
            while reserved < upto:
                self._append(seq_id, token_ids[reserved] if reserved < known else UNKNOWN_TOKEN, reserved)
                reserved += 1
        except OutOfBlocksError:  # all or nothing per token: the pool is unchanged
            pass
        return reserved

    def set_token(self, seq_id: int, position: int, token_id: int) -> None:
        """Give a token reserved as ``UNKNOWN_TOKEN`` its id, once sampled
        (no-op for a position not reserved yet)."""
        if position < self.block_manager.num_tokens(seq_id):
            self.block_manager.set_token(seq_id, position, token_id)

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        """Give back the room reserved past ``num_tokens`` tokens (rejected
        drafts): blocks that hold none of the kept tokens are freed."""
        self.block_manager.truncate(seq_id, num_tokens)
        keep = -(-num_tokens // self.block_size)
        for tables in self._tables:
            tables.truncate(seq_id, keep)

    def fork_seq(self, seq_id: int) -> int:
        """A new seq_id sharing all of ``seq_id``'s blocks copy-on-write."""
        child = self._new_seq_id()
        self.block_manager.fork(seq_id, child)
        for tables, released in zip(self._tables, self._released, strict=True):
            tables.fork(seq_id, child)
            released[child] = released.get(seq_id, 0)
        return child

    def mark_computed(self, seq_id: int, num_tokens: int) -> None:
        """Commit: the seq_id's first ``num_tokens`` tokens are written, so their
        full blocks may enter the prefix cache."""
        if self.block_manager.mark_computed(seq_id, num_tokens) and self._null is not None:
            self._mirror_released(seq_id)

    # -- operators -------------------------------------------------------------
    def audit(self) -> list[str]:
        """The block manager's audit, the seq_id bookkeeping, and the mirrored
        page tables against the block manager's."""
        bm = self.block_manager
        problems = list(bm.audit())
        live = set(bm.seq_ids())
        for g, tables in enumerate(self._tables):
            where = f" (KV cache group {g})" if len(self._tables) > 1 else ""
            for seq_id in bm.seq_ids():
                if seq_id not in tables:
                    problems.append(f"sequence {seq_id} has no page-table row{where}")
                elif tables.blocks(seq_id) != bm.block_table(seq_id, g):
                    problems.append(
                        f"sequence {seq_id}: page-table row {tables.blocks(seq_id)} differs "
                        f"from the block manager's {bm.block_table(seq_id, g)}{where}"
                    )
            for handle in tables.handles():
                if handle not in live:
                    problems.append(f"page-table row kept for sequence {handle}, which is freed")
        usable = self.num_blocks - (self._null is not None)
        if bm.num_blocks != usable:
            problems.append(f"block manager has {bm.num_blocks} blocks, the cache has {usable}")
        return problems

    def reclaim_leaked(self) -> list[int]:
        """Free blocks no page table references (after a bug); returns them."""
        return self.block_manager.reclaim_leaked()

    def stats(self) -> dict[str, float]:
        """The block counters; with several KV cache groups also each group's
        blocks in use (``group_<g>_blocks_used``)."""
        out = self.block_manager.stats().as_dict()
        if len(self._tables) > 1:
            for g, used in enumerate(self.block_manager.group_blocks_used()):
                out[f"group_{g}_blocks_used"] = used
        return out

    def block_table(self, seq_id: int, group: int = 0) -> list[int]:
        """The seq_id's block ids in token order."""
        return self.block_manager.block_table(seq_id, group)

    # -- each step ---------------------------------------------------------------
    def step_layout(
        self, seq_ids: Sequence[int], starts: Sequence[int], new_lens: Sequence[int]
    ) -> StepLayout:
        """Where one step's tokens go: seq_id ``i`` computes ``new_lens[i]``
        tokens from ``starts[i]``, every one reserved before; the copies
        copy-on-write asked for since the last layout ride along."""
        bs = self.block_size
        rooms = self.block_manager.num_tokens_of(seq_ids)
        ends = np.add(starts, new_lens, dtype=np.int64)  # one array op, not one per sequence
        over = np.flatnonzero(ends > rooms)
        if len(over):
            i = int(over[0])
            raise RuntimeError(
                f"seq_id {seq_ids[i]} has room for {rooms[i]} tokens but this step writes up to "
                f"position {ends[i] - 1}; reserve first (allocate_sequence / append_token)"
            )
        width = -(-int(ends.max(initial=1)) // bs)
        if len(self._tables) == 1:
            buffer = self._tables[0]
            tables = buffer.gather(buffer.rows(seq_ids), width)
        else:  # [groups, batch, width]: one metadata build and device copy for all groups
            tables = np.stack([b.gather(b.rows(seq_ids), width) for b in self._tables])
        tiers = self.block_manager.tiers
        ops = tiers.take_commands() if tiers is not None else []
        return StepLayout(tables, list(starts), list(new_lens), self.take_copies(), ops)

    def take_copies(self) -> list[list[tuple[int, int]]]:
        """The block copies asked for since the last call (one ``copy_blocks``
        call's pairs), to be made before the cache is next read or written."""
        copies, self._pending_copies = self._pending_copies, []
        return [copies] if copies else []

    # -- internals -----------------------------------------------------------
    def _append(self, seq_id: int, token_id: int, num_reserved: int) -> None:
        """``append_token`` given the seq_id's ``num_reserved`` tokens so far."""
        copies = self.block_manager.append(seq_id, token_id)
        if copies or num_reserved % self.block_size == 0:  # else it fits the last blocks
            self._sync_table(seq_id, copies)

    def _sync_table(self, seq_id: int, copies: Sequence[tuple[int, int, int]] = ()) -> None:
        """Mirror the block manager's table change for ``seq_id`` into every
        group's buffer: a copy-on-write (``(group, src, dst)``) swaps that
        group's last block, an append adds blocks."""
        bm = self.block_manager
        for g, buffer in enumerate(self._tables):
            if seq_id not in buffer:
                buffer.add(seq_id, bm.block_table(seq_id, g))
                self._released[g][seq_id] = bm.num_released(seq_id, g)
                continue
            for _, _, dst in (c for c in copies if c[0] == g):
                buffer.set(seq_id, buffer.num_blocks(seq_id) - 1, dst)
            buffer.extend(seq_id, bm.block_table(seq_id, g, buffer.num_blocks(seq_id)))
        self._pending_copies.extend((src, dst) for _, src, dst in copies)

    def _mirror_released(self, seq_id: int) -> None:
        """Entries a sliding group just freed point at the null block in the
        mirror too, so no kernel can read a block another sequence now owns."""
        for g, (buffer, released) in enumerate(zip(self._tables, self._released, strict=True)):
            if self.windows[g] is None:
                continue
            old, new = released.get(seq_id, 0), self.block_manager.num_released(seq_id, g)
            for i in range(old, new):
                buffer.set(seq_id, i, self._null)  # type: ignore[arg-type]
            released[seq_id] = new

    def _new_seq_id(self) -> int:
        seq_id = self._next_seq_id
        self._next_seq_id += 1
        return seq_id
