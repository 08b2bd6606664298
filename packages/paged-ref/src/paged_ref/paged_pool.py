"""Block-paged KV cache pool: tensors here, page tables in ``BlockManager``.

``k_cache``/``v_cache`` are ``[cache_layers, num_blocks, block_size, kv_heads,
head_dim]`` (a token's K for all heads is one contiguous row, so writes are
row copies and a gathered context is a strided view, not a permute); a seq_id
is a sequence id of the block manager. The layers form KV cache groups
(``paged_core.kv_cache_groups``): one group of every layer unless sliding
windows make the model hybrid; then each group of ``k`` layers has its own
page tables over the shared blocks and layer ``l`` lives at cache layer ``j``
of the tensors (``locate_layer``). The pool adds what the block managers
cannot do without tensors: page tables mirrored into host tensors
(``BlockTableBuffer``, one per group), copy-on-write block copies batched
until the next view, and views that write and attend through an ``ops``
module (``paged_ref.ops`` by default; the server passes ``paged_triton.ops``,
so this package never imports triton).
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType

import numpy as np
import torch
from torch import Tensor

from paged_core.block_manager import BlockManager
from paged_core.errors import OutOfBlocksError
from paged_core.kv_cache_groups import KVCacheGroup, cache_layers
from paged_ref import ops as ref_ops
from paged_ref.attention_metadata import AttentionMetadata, build_metadata
from paged_ref.block_table_buffer import BlockTableBuffer
from paged_ref.cache_view import ViewsMixin
from paged_ref.kv_int4 import int4_block_bytes, is_int4
from paged_ref.kv_quant import (
    cache_dtype_for,
    kv_bytes_per_token,
    new_scales,
    scale_keywords,
    storage_shape,
)
from paged_ref.seed_views import SeedViews


def block_bytes(
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    static_scales: bool = False,
) -> int:
    """Bytes one block id takes across ``num_layers`` layers (a KV cache
    group's cache layers), K and V together (an int8 cache's per-token scales
    included, none with ``static_scales``); ``dtype`` is the cache's storage
    dtype."""
    if is_int4(dtype):  # key scales are per group of tokens: count a whole block's
        return int4_block_bytes(num_layers, num_kv_heads, head_dim, block_size)
    return block_size * kv_bytes_per_token(num_layers, num_kv_heads, head_dim, dtype, static_scales)


class PagedKVPool(SeedViews, ViewsMixin):
    """A block pool satisfying ``ServingPoolProtocol`` (see module doc).

    A seq_id's length (``get_num_computed_tokens``) counts tokens whose KV is committed;
    ``get_num_reserved`` counts tokens with room reserved, which is more
    between ``append_token`` and the step that writes the token.
    """

    def __init__(
        self,
        k_cache: Tensor,
        v_cache: Tensor,
        *,
        enable_prefix_caching: bool = True,
        ops: ModuleType | None = None,
        k_scales: Tensor | None = None,
        v_scales: Tensor | None = None,
        kv_scales: tuple[Tensor, Tensor] | None = None,
        groups: Sequence[KVCacheGroup] | None = None,
    ) -> None:
        num_layers = sum(len(g.layers) for g in groups) if groups else None
        shape = self._hold(
            k_cache, v_cache, k_scales, v_scales, ops if ops is not None else ref_ops,
            "num_blocks, block_size", kv_scales, num_layers,
        )  # fmt: skip
        self.num_cache_layers, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim = shape
        self.groups = list(groups or [KVCacheGroup(tuple(range(self.num_cache_layers)), None)])
        # A pipeline stage's groups may hold fewer layers (``stage_groups``), even none.
        if max(len(g.layers) for g in self.groups) != self.num_cache_layers:
            raise ValueError(
                f"the cache tensors have {self.num_cache_layers} cache layers but the KV cache groups "
                f"hold {[len(g.layers) for g in self.groups]} layers; build the tensors with "
                "one cache layer per layer of the fullest group"
            )
        self.num_layers = sum(len(g.layers) for g in self.groups)
        self._cache_layers = cache_layers(self.groups)
        # The block manager reserves the last block as the null block when a group slides.
        self.block_manager = BlockManager(
            self.num_blocks, self.block_size, enable_prefix_caching,
            sliding_windows=[g.sliding_window for g in self.groups],
        )  # fmt: skip
        self._null = self.block_manager.null_block_id
        self._tables = [BlockTableBuffer() for _ in self.groups]
        self._released = [dict[int, int]() for _ in self.groups]  # mirrored null entries
        self._pending_copies: list[tuple[int, int]] = []
        self._next_seq_id = 0

    @staticmethod
    def from_model_config(
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int = 16,
        dtype: torch.dtype = torch.bfloat16,
        device: str | torch.device = "cpu",
        *,
        enable_prefix_caching: bool = True,
        ops: ModuleType | None = None,
        kv_cache_dtype: str = "auto",
        kv_scales: tuple[Tensor, Tensor] | None = None,
        groups: Sequence[KVCacheGroup] | None = None,
    ) -> PagedKVPool:
        """A zeroed pool of ``num_blocks`` blocks for a model's shape
        (``device="meta"`` sizes it without allocating memory). ``dtype`` is
        the model's; ``kv_cache_dtype`` (``auto``, ``fp8``, ``fp8_e4m3``,
        ``fp8_e5m2``, ``int8``) picks what the blocks store; ``kv_scales``
        (static K and V scales, ``[num_layers, num_kv_heads]``, from
        ``calculate_kv_scales``) replaces int8's per-token scales and fp8's
        scale of 1. ``groups``: the model's KV cache groups
        (``paged_core.kv_cache_groups``; default one group of every layer);
        with several, a block holds one group's layers, so it costs fewer
        bytes, and sliding groups free old blocks. A pipeline stage passes
        its ``stage_groups`` and ``num_layers`` = the layers they hold."""
        groups = list(groups or [KVCacheGroup(tuple(range(num_layers)), None)])
        if sum(len(g.layers) for g in groups) != num_layers:
            raise ValueError(f"the KV cache groups hold {sum(len(g.layers) for g in groups)} layers, not {num_layers}")
        shape = (max(len(g.layers) for g in groups), num_blocks, block_size, num_kv_heads, head_dim)
        cache_dtype = cache_dtype_for(kv_cache_dtype, dtype)
        k_cache = torch.zeros(storage_shape(shape, cache_dtype), dtype=cache_dtype, device=device)
        v_cache = torch.zeros(storage_shape(shape, cache_dtype), dtype=cache_dtype, device=device)
        static = kv_scales is not None
        return PagedKVPool(
            k_cache,
            v_cache,
            enable_prefix_caching=enable_prefix_caching,
            ops=ops,
            k_scales=new_scales(k_cache, static, "k_scales"),
            v_scales=new_scales(v_cache, static, "v_scales"),
            kv_scales=kv_scales,
            groups=groups,
        )

    @staticmethod
    def num_blocks_for_memory(
        budget_bytes: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        dtype: torch.dtype,
        static_scales: bool = False,
    ) -> int:
        """How many blocks fit in ``budget_bytes`` of K+V memory (``dtype``:
        the cache's storage dtype; int8 per-token scales count against the
        budget, static ones are per layer and do not)."""
        return budget_bytes // block_bytes(
            num_layers, num_kv_heads, head_dim, block_size, dtype, static_scales
        )

    def kv_bytes(self) -> int:
        """Bytes held by the K and V tensors together, per-token scales
        included (static scales, 8 bytes per layer and kv head, are not
        token storage)."""
        tensors = (self.k_cache, self.v_cache, self.k_scales, self.v_scales)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    # -- CachePoolProtocol -------------------------------------------------
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

    def is_paged(self) -> bool:
        return True

    # -- ServingPoolProtocol -------------------------------------------------
    def can_allocate_sequence(
        self, token_ids: Sequence[int], *, skip_prefix_cache: bool = False,
        num_reserved: int | None = None,
    ) -> bool:  # fmt: skip
        return self.can_allocate_sequences(
            [token_ids], skip_prefix_cache=skip_prefix_cache, num_reserved=num_reserved
        )

    def can_allocate_sequences(
        self, token_ids: Sequence[Sequence[int]], *, skip_prefix_cache: bool = False,
        num_reserved: int | None = None,
    ) -> bool:  # fmt: skip
        """Whether all of them fit at once (hits on the same free cached block
        are counted once per sequence: never optimistic)."""
        bm = self.block_manager
        if not all(token_ids):
            return False
        needed = sum(
            bm.num_blocks_needed(t, skip_prefix_cache=skip_prefix_cache, num_reserved=num_reserved)
            for t in token_ids
        )
        return needed <= bm.num_free_blocks()

    def allocate_sequence(
        self, token_ids: Sequence[int], *, skip_prefix_cache: bool = False,
        num_reserved: int | None = None,
    ) -> tuple[int, int]:  # fmt: skip
        """A seq_id for the prompt; returns ``(seq_id, num_cached_tokens)`` where the
        first ``num_cached_tokens`` come from the prefix cache. With
        ``num_reserved`` only that many tokens (at least the hit + 1) get room
        now; ``append_token`` reserves the rest."""
        seq_id = self._new_seq_id()
        cached = self.block_manager.allocate(
            seq_id, token_ids, skip_prefix_cache=skip_prefix_cache, num_reserved=num_reserved
        )
        self._sync_table(seq_id)
        return seq_id, cached

    def can_append(self, seq_ids: Sequence[int]) -> bool:
        """Whether every seq_id can grow by one token right now (exact)."""
        return self.block_manager.can_append(seq_ids)

    def append_token(self, seq_id: int, token_id: int) -> None:
        """Reserve room for ``token_id``. If its block is shared, the seq_id gets
        a private copy, made before the next view reads or writes the cache."""
        self._append(seq_id, token_id, self.block_manager.num_tokens(seq_id))

    def get_num_reserved(self, seq_id: int) -> int:
        """Tokens the seq_id has room for (committed + reserved ahead)."""
        return self.block_manager.num_tokens(seq_id)

    def reserve(self, seq_id: int, token_ids: Sequence[int], upto: int) -> int:
        """``append_token`` for ``token_ids[reserved:upto]`` while blocks last;
        returns how many tokens have room (``< upto``: out of blocks)."""
        reserved = self.block_manager.num_tokens(seq_id)
        try:
            while reserved < upto:
                self._append(seq_id, token_ids[reserved], reserved)
                reserved += 1
        except OutOfBlocksError:  # all or nothing per token: the pool is unchanged
            pass
        return reserved

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

    def audit(self) -> list[str]:
        """The block manager's audit, the pool's own seq_id bookkeeping, and the
        mirrored page tables against the block manager's."""
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
            problems.append(f"block manager has {bm.num_blocks} blocks, tensors have {usable}")
        return problems

    def reclaim_leaked(self) -> list[int]:
        """Free blocks no page table references (after a bug); returns them."""
        return self.block_manager.reclaim_leaked()

    def stats(self) -> dict[str, float]:
        """The block counters; with several KV cache groups also each group's
        blocks in use (``group_<g>_blocks_used``)."""
        out = self.block_manager.stats().as_dict()
        if len(self.groups) > 1:
            for g, used in enumerate(self.block_manager.group_blocks_used()):
                out[f"group_{g}_blocks_used"] = used
        return out

    def locate_layer(self, layer_idx: int) -> tuple[int, int, int | None]:
        """``(group, cache layer, group window)`` of model layer ``layer_idx``."""
        where = self._cache_layers.get(layer_idx)
        if where is None:
            raise IndexError(f"layer {layer_idx} is not one of this pool's {self.num_layers} layers")
        group, cache_layer = where
        return group, cache_layer, self.groups[group].sliding_window

    # -- used by the views -----------------------------------------------------
    def block_table(self, seq_id: int, group: int = 0) -> list[int]:
        """The seq_id's block ids in token order."""
        return self.block_manager.block_table(seq_id, group)

    def build_metadata(
        self, seq_ids: Sequence[int], starts: Sequence[int], new_lens: Sequence[int]
    ) -> AttentionMetadata:
        """A view's step metadata; copies pending from copy-on-write run first,
        so every block the step reads or writes holds its data."""
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
        self._flush_copies()
        if len(self._tables) == 1:
            buffer = self._tables[0]
            tables = buffer.gather(buffer.rows(seq_ids), width)
        else:  # [groups, batch, width]: one metadata build and device copy for all groups
            tables = torch.stack([b.gather(b.rows(seq_ids), width) for b in self._tables])
        return build_metadata(tables, starts, new_lens, bs, self.k_cache.device)

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
            if self.groups[g].sliding_window is None:
                continue
            old, new = released.get(seq_id, 0), self.block_manager.num_released(seq_id, g)
            for i in range(old, new):
                buffer.set(seq_id, i, self._null)  # type: ignore[arg-type]
            released[seq_id] = new

    def _flush_copies(self) -> None:
        if self._pending_copies:
            pairs, self._pending_copies = self._pending_copies, []
            self.ops.copy_blocks(  # host pairs: one upload; int8 per-token scales copied too
                self.k_cache, self.v_cache, pairs, **scale_keywords(self.k_scales, self.v_scales)
            )

    def _new_seq_id(self) -> int:
        seq_id = self._next_seq_id
        self._next_seq_id += 1
        return seq_id

