"""Views over a :class:`~paged_ref.paged_pool.PagedKVCachePool` for one forward pass.

One generic class, :class:`PagedCacheView`, covers fresh prefill, batched
(right-padded) prefill, decode, and queries attending to cached context
(prefix-cache hits, later chunks of a chunked prefill): each slot's new
tokens start at its current length. The design documents' named views are
thin constructors of it.

Per step, on first use (layer 0), the view reserves any missing blocks and
builds the ops' metadata once: ``block_tables``, ``seq_lens``,
``cu_seqlens_q`` and ``slot_mapping``. Every layer then costs one
``write_kv`` and one attention op from ``pool.ops``; no Python loop runs over
sequences per layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from paged_ref.view_base import CacheViewBase, TokenLayout

if TYPE_CHECKING:
    from paged_ref.paged_pool import PagedKVCachePool


@dataclass(slots=True)
class PagedStepMetadata:
    """The ops' arguments for one step, shared by every layer."""

    block_tables: Tensor  # [batch, max_blocks] int32, unused entries 0
    seq_lens: Tensor  # [batch] int32: context including this pass's tokens
    cu_seqlens_q: Tensor  # [batch + 1] int32 over real tokens
    slot_mapping: Tensor  # [batch * padded_len] int64, -1 at padding
    real_rows: Tensor | None  # flat indices of real tokens; None when nothing is padding


class PagedCacheView(CacheViewBase):
    """Slots of a paged pool with per-slot (start, new_len); see module doc."""

    def __init__(
        self,
        pool: PagedKVCachePool,
        slots: Sequence[int],
        new_lens: Sequence[int] | None = None,
    ) -> None:
        super().__init__(slots, [pool.get_seq_len(s) for s in slots], new_lens)
        self.pool = pool
        self.meta: PagedStepMetadata | None = None
        self._gather_blocks: Tensor | None = None
        self._gather_offsets: Tensor | None = None

    def is_paged(self) -> bool:
        return True

    def update(self, layer_idx: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write the real tokens of ``k``/``v`` (``[batch, kv_heads, new_len, head_dim]``)
        into their blocks. Returns the input when no slot has cached context,
        else each slot's context gathered to ``[batch, kv_heads, max(start) + new_len,
        head_dim]`` (position ``p`` at index ``p``; beyond a slot's length: junk)."""
        layout = self._write(layer_idx, k, v)
        if layout.all_fresh:
            return k, v
        blocks, offsets = self._gather_indices(layout)
        # Advanced indices around a slice: result is [batch, max_end, kv_heads, head_dim].
        k_all = self.pool.k_cache[layer_idx][blocks, :, offsets]
        v_all = self.pool.v_cache[layer_idx][blocks, :, offsets]
        return k_all.permute(0, 2, 1, 3), v_all.permute(0, 2, 1, 3)

    def attend(
        self,
        layer_idx: int,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        scale: float,
        sliding_window: int | None = None,
        softcap: float | None = None,
    ) -> Tensor:
        """``write_kv`` then the pool's paged decode or prefill attention op.
        ``q``: ``[batch, heads, new_len, head_dim]``; padding rows come back zero."""
        layout = self._write(layer_idx, k, v)
        meta = self.meta
        assert meta is not None
        ops = self.pool.ops
        k_cache, v_cache = self.pool.k_cache[layer_idx], self.pool.v_cache[layer_idx]
        if layout.is_decode:
            out = ops.paged_decode_attention(
                q[:, :, 0], k_cache, v_cache, meta.block_tables, meta.seq_lens,
                scale, sliding_window, softcap,
            )  # fmt: skip
            return out.unsqueeze(2)
        batch, heads, padded_len, head_dim = q.shape
        q_flat = q.transpose(1, 2).reshape(batch * padded_len, heads, head_dim)
        q_packed = q_flat if meta.real_rows is None else q_flat[meta.real_rows]
        out = ops.paged_prefill_attention(
            q_packed, k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q, meta.seq_lens,
            scale, sliding_window, softcap,
        )  # fmt: skip
        if meta.real_rows is not None:
            out = out.new_zeros(q_flat.shape).index_copy_(0, meta.real_rows, out)
        return out.view(batch, padded_len, heads, head_dim).transpose(1, 2)

    # -- internals -----------------------------------------------------------
    def _write(self, layer_idx: int, k: Tensor, v: Tensor) -> TokenLayout:
        layout = self.layout(k.shape[2], self.pool.k_cache.device)
        assert self.meta is not None
        batch, kv_heads, padded_len, head_dim = k.shape
        self.pool.ops.write_kv(
            self.pool.k_cache[layer_idx],
            self.pool.v_cache[layer_idx],
            k.transpose(1, 2).reshape(batch * padded_len, kv_heads, head_dim),
            v.transpose(1, 2).reshape(batch * padded_len, kv_heads, head_dim),
            self.meta.slot_mapping,
        )
        return layout

    def _prepare(self, layout: TokenLayout) -> None:
        """Reserve missing blocks, then build the step's metadata (once, on layer 0)."""
        ends = [s + n for s, n in zip(layout.starts, layout.new_lens, strict=True)]
        for slot, end in zip(self.slots, ends, strict=True):
            self.pool.ensure_reserved(slot, end)
        device = self.pool.k_cache.device
        bs = self.pool.block_size
        tables = [
            self.pool.block_table(s)[: -(-e // bs)] for s, e in zip(self.slots, ends, strict=True)
        ]
        width = max((len(t) for t in tables), default=0) or 1
        block_tables = torch.zeros(len(tables), width, dtype=torch.int32)
        for i, table in enumerate(tables):
            block_tables[i, : len(table)] = torch.tensor(table, dtype=torch.int32)
        block_tables = block_tables.to(device)

        lens = torch.tensor(layout.new_lens, dtype=torch.int32)
        cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
        cu[1:] = lens.cumsum(0)
        flat_real = layout.batch_idx * layout.padded_len + layout.tok_idx
        pos = layout.positions
        slot_mapping = torch.full(
            (len(self.slots) * layout.padded_len,), -1, dtype=torch.long, device=device
        )
        slot_mapping[flat_real] = block_tables[layout.batch_idx, pos // bs].long() * bs + pos % bs
        self.meta = PagedStepMetadata(
            block_tables=block_tables,
            seq_lens=layout.kv_lens.to(torch.int32),
            cu_seqlens_q=cu.to(device),
            slot_mapping=slot_mapping,
            real_rows=None if layout.num_real == slot_mapping.numel() else flat_real,
        )

    def _gather_indices(self, layout: TokenLayout) -> tuple[Tensor, Tensor]:
        """``[batch, max_end]`` block ids and offsets for ``update``'s flat gather,
        built once per step (positions past a slot's end read block 0)."""
        if self._gather_blocks is None or self._gather_offsets is None:
            assert self.meta is not None
            bs = self.pool.block_size
            device = self.pool.k_cache.device
            pos = torch.arange(layout.max_end, device=device).unsqueeze(0)
            logical = (pos // bs).clamp(max=self.meta.block_tables.shape[1] - 1)
            blocks = self.meta.block_tables.long().gather(1, logical.expand(len(self.slots), -1))
            visible = pos < layout.kv_lens.unsqueeze(1)
            self._gather_blocks = torch.where(visible, blocks, 0)
            self._gather_offsets = (pos % bs).expand_as(blocks)
        return self._gather_blocks, self._gather_offsets

    def advance(self, n: int) -> None:
        super().advance(n)
        self.meta = None
        self._gather_blocks = self._gather_offsets = None

    def _commit(self, slot: int, new_len: int) -> None:
        self.pool.mark_computed(slot, new_len)


class PagedPrefillCacheView(PagedCacheView):
    """One slot; all positions of ``k``/``v`` are real, written from the slot's
    current length (after prefix hits or earlier chunks)."""

    def __init__(self, pool: PagedKVCachePool, slot: int) -> None:
        super().__init__(pool, [slot])
        self.slot = slot


class PagedBatchedPrefillCacheView(PagedCacheView):
    """A right-padded batch; only the first ``prompt_lens[i]`` positions of row
    ``i`` are written (padding takes no block space)."""

    def __init__(self, pool: PagedKVCachePool, slots: list[int], prompt_lens: list[int]) -> None:
        super().__init__(pool, slots, prompt_lens)
        self.prompt_lens = list(prompt_lens)


class PagedDecodeCacheView(PagedCacheView):
    """One new token per slot at its current length (blocks grow lazily if
    ``append_token`` did not reserve them)."""

    def __init__(self, pool: PagedKVCachePool, slots: list[int]) -> None:
        super().__init__(pool, slots, [1] * len(slots))
