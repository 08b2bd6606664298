"""Views over a :class:`~paged_ref.slotted.SlottedKVCache` for one forward pass.

One generic class, :class:`SlottedCacheView`; the design documents' three
views are thin constructors of it. Each slot's new tokens are written at its
current length, so chunked prefill works the same way as a fresh prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from torch import Tensor

from paged_ref.attention import context_mask, masked_attention
from paged_ref.view_base import CacheViewBase, TokenLayout

if TYPE_CHECKING:
    from paged_ref.slotted import SlottedKVCache


class SlottedCacheView(CacheViewBase):
    """Writes the real new tokens of each slot in one indexed store per layer,
    and attends over the slot's rows with the shared dense attention."""

    def __init__(
        self, pool: SlottedKVCache, slots: Sequence[int], new_lens: Sequence[int] | None = None
    ) -> None:
        super().__init__(slots, [pool.get_seq_len(s) for s in slots], new_lens)
        self.pool = pool
        self._slot_idx: Tensor | None = None
        self._masks: dict[tuple[int | None, int], Tensor] = {}

    def is_paged(self) -> bool:
        return False

    def update(self, layer_idx: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store the real tokens of ``k``/``v`` (``[batch, kv_heads, new_len, head_dim]``).

        Returns the input when no slot has cached context (fresh prefill),
        else each slot's rows ``[batch, kv_heads, max(start) + new_len, head_dim]``
        (position ``p`` at index ``p``; beyond a slot's length: stale data).
        """
        layout = self._write(layer_idx, k, v)
        if layout.all_fresh:
            return k, v
        return self._gather(layer_idx, layout)

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
        """``update`` + causal/window/padding mask + dense attention."""
        layout = self._write(layer_idx, k, v)
        keys, values = (k, v) if layout.all_fresh else self._gather(layer_idx, layout)
        mask_key = (sliding_window, keys.shape[2])
        mask = self._masks.get(mask_key)
        if mask is None:
            mask = context_mask(
                layout.q_positions, layout.kv_lens, keys.shape[2], sliding_window, layout.q_valid
            )
            self._masks[mask_key] = mask
        return masked_attention(q, keys, values, mask, scale, softcap)

    def advance(self, n: int) -> None:
        super().advance(n)
        self._masks.clear()

    # -- internals -----------------------------------------------------------
    def _prepare(self, layout: TokenLayout) -> None:
        for slot, start, n in zip(self.slots, layout.starts, layout.new_lens, strict=True):
            if start + n > self.pool.max_seq_len:
                raise ValueError(
                    f"slot {slot} would hold {start + n} tokens but max_seq_len is "
                    f"{self.pool.max_seq_len}"
                )
        device = self.pool.k_cache.device
        self._slot_idx = layout.batch_idx.new_tensor(self.slots, device=device)

    def _write(self, layer_idx: int, k: Tensor, v: Tensor) -> TokenLayout:
        layout = self.layout(k.shape[2], self.pool.k_cache.device)
        assert self._slot_idx is not None
        if layout.num_real:
            rows = self._slot_idx[layout.batch_idx]
            # [n_real, kv_heads, head_dim] on both sides of each store.
            self.pool.k_cache[layer_idx][rows, :, layout.positions] = k[
                layout.batch_idx, :, layout.tok_idx
            ].to(self.pool.k_cache.dtype)
            self.pool.v_cache[layer_idx][rows, :, layout.positions] = v[
                layout.batch_idx, :, layout.tok_idx
            ].to(self.pool.v_cache.dtype)
        return layout

    def _gather(self, layer_idx: int, layout: TokenLayout) -> tuple[Tensor, Tensor]:
        end = min(layout.max_end, self.pool.max_seq_len)
        return (
            self.pool.k_cache[layer_idx][self._slot_idx, :, :end],
            self.pool.v_cache[layer_idx][self._slot_idx, :, :end],
        )

    def _commit(self, slot: int, new_len: int) -> None:
        self.pool.set_seq_len(slot, new_len)


class PrefillCacheView(SlottedCacheView):
    """One slot; every position of ``k``/``v`` is real, written from the
    slot's current length (0 for a fresh prompt, more for a later chunk)."""

    def __init__(self, pool: SlottedKVCache, slot: int) -> None:
        super().__init__(pool, [slot])
        self.slot = slot


class BatchedPrefillCacheView(SlottedCacheView):
    """A right-padded batch; only the first ``prompt_lens[i]`` positions of row
    ``i`` are written, and ``advance`` adds exactly those."""

    def __init__(self, pool: SlottedKVCache, slots: list[int], prompt_lens: list[int]) -> None:
        super().__init__(pool, slots, prompt_lens)
        self.prompt_lens = list(prompt_lens)


class DecodeCacheView(SlottedCacheView):
    """One new token per slot at its current length; ``update`` returns the
    gathered rows ``[batch, kv_heads, max_len + 1, head_dim]``."""

    def __init__(self, pool: SlottedKVCache, slots: list[int]) -> None:
        super().__init__(pool, slots, [1] * len(slots))
