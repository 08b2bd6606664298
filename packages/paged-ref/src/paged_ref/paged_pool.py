"""Block-paged KV cache pool: tensors here, page tables in ``BlockManager``.

``k_cache``/``v_cache`` are ``[layers, num_blocks, kv_heads, block_size,
head_dim]``; a slot is a sequence id of the block manager. The pool adds
what the block manager cannot do without tensors: block copies for
copy-on-write, and views that write and attend through an ``ops`` module
(``paged_ref.ops`` by default; the server passes ``paged_triton.ops``, so
this package never imports triton).
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType

import torch
from torch import Tensor

from paged_core.block_manager import BlockManager
from paged_ref import ops as ref_ops
from paged_ref.paged_views import (
    PagedBatchedPrefillCacheView,
    PagedCacheView,
    PagedDecodeCacheView,
    PagedPrefillCacheView,
)


def block_bytes(
    num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype
) -> int:
    """Bytes one block id takes across all layers, K and V together."""
    itemsize = torch.empty((), dtype=dtype, device="meta").element_size()
    return 2 * num_layers * num_kv_heads * block_size * head_dim * itemsize


class PagedKVCachePool:
    """A block pool satisfying ``ServingPoolProtocol`` (see module doc).

    A slot's length (``get_seq_len``) counts tokens whose KV is written;
    the block manager's ``seq_len`` counts tokens reserved, which is more
    between ``append_token`` and the decode step that writes the token.
    """

    def __init__(
        self,
        k_cache: Tensor,
        v_cache: Tensor,
        *,
        enable_prefix_caching: bool = True,
        ops: ModuleType | None = None,
    ) -> None:
        if k_cache.shape != v_cache.shape or k_cache.dim() != 5:
            raise ValueError(
                "k_cache and v_cache must both be [layers, num_blocks, kv_heads, block_size, "
                f"head_dim], got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
            )
        self.k_cache = k_cache
        self.v_cache = v_cache
        self.num_layers, self.num_blocks, self.num_kv_heads, self.block_size, self.head_dim = (
            k_cache.shape
        )
        self.ops = ops if ops is not None else ref_ops
        self.block_manager = BlockManager(self.num_blocks, self.block_size, enable_prefix_caching)
        self._slots: set[int] = set()  # live slots, including ones with no block yet
        self._next_slot = 0

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
    ) -> PagedKVCachePool:
        """A zeroed pool of ``num_blocks`` blocks for a model's shape
        (``device="meta"`` sizes it without allocating memory)."""
        shape = (num_layers, num_blocks, num_kv_heads, block_size, head_dim)
        return PagedKVCachePool(
            torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device),
            enable_prefix_caching=enable_prefix_caching,
            ops=ops,
        )

    @staticmethod
    def num_blocks_for_memory(
        budget_bytes: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        dtype: torch.dtype,
    ) -> int:
        """How many blocks fit in ``budget_bytes`` of K+V memory."""
        return budget_bytes // block_bytes(num_layers, num_kv_heads, head_dim, block_size, dtype)

    def kv_bytes(self) -> int:
        """Bytes held by the K and V tensors together."""
        return sum(t.numel() * t.element_size() for t in (self.k_cache, self.v_cache))

    # -- CachePoolProtocol -------------------------------------------------
    def allocate_slot(self, initial_tokens: int = 0) -> int:
        """A new slot with blocks for ``initial_tokens`` tokens, taken eagerly so
        an exhausted pool fails here, before any forward pass. All or nothing."""
        if initial_tokens < 0:
            raise ValueError(f"initial_tokens must be >= 0, got {initial_tokens}")
        slot = self._new_slot_id()
        if initial_tokens:
            self.block_manager.allocate(slot, initial_tokens)
        self._slots.add(slot)
        return slot

    def free_slot(self, slot: int) -> None:
        """Release the slot's blocks (prefix-cached ones stay evictable)."""
        self._check_live(slot)
        if self.block_manager.has_seq(slot):
            self.block_manager.free(slot)
        self._slots.remove(slot)

    def get_seq_len(self, slot: int) -> int:
        """Tokens whose KV is in the cache (prefix hits included)."""
        self._check_live(slot)
        if not self.block_manager.has_seq(slot):
            return 0
        return self.block_manager.num_computed_tokens(slot)

    def free_slot_count(self) -> int:
        """Free blocks: a bound on how many more sequences fit."""
        return self.block_manager.num_free_blocks()

    def free_token_capacity(self) -> int:
        return self.block_manager.free_token_capacity()

    def is_paged(self) -> bool:
        return True

    def prefill_view(self, slot: int) -> PagedPrefillCacheView:
        return PagedPrefillCacheView(self, slot)

    def decode_view(self, slots: list[int]) -> PagedDecodeCacheView:
        return PagedDecodeCacheView(self, slots)

    def batched_prefill_view(
        self, slots: list[int], prompt_lens: list[int]
    ) -> PagedBatchedPrefillCacheView:
        return PagedBatchedPrefillCacheView(self, slots, prompt_lens)

    def view(self, slots: Sequence[int], new_lens: Sequence[int] | None = None) -> PagedCacheView:
        """The generic view: slot ``i`` gets ``new_lens[i]`` new tokens at its length."""
        return PagedCacheView(self, slots, new_lens)

    # -- ServingPoolProtocol -------------------------------------------------
    def can_allocate_sequence(self, token_ids: Sequence[int]) -> bool:
        return len(token_ids) > 0 and self.block_manager.can_allocate(len(token_ids), token_ids)

    def allocate_sequence(self, token_ids: Sequence[int]) -> tuple[int, int]:
        """A slot for the prompt; returns ``(slot, num_cached_tokens)`` where the
        first ``num_cached_tokens`` come from the prefix cache."""
        slot = self._new_slot_id()
        cached = self.block_manager.allocate(slot, len(token_ids), list(token_ids))
        self._slots.add(slot)
        return slot, cached

    def can_append(self, slots: Sequence[int]) -> bool:
        """Whether every slot can grow by one token right now (exact, from the
        block manager; a slot that has no block yet counts one per slot, a
        safe bound since one token never needs more than one new block)."""
        bm = self.block_manager
        with_blocks = [s for s in slots if bm.has_seq(s)]
        if len(with_blocks) == len(slots):
            return bm.can_append(with_blocks)
        return len(slots) <= bm.num_free_blocks()

    def append_token(self, slot: int, token_id: int) -> None:
        """Reserve room for ``token_id``; copies a shared last block first (CoW)."""
        self._check_live(slot)
        bm = self.block_manager
        if not bm.has_seq(slot):
            bm.allocate(slot, 1, [token_id])
            return
        self._copy(bm.append(slot, token_id))

    def fork_slot(self, slot: int) -> int:
        """A new slot sharing all of ``slot``'s blocks copy-on-write."""
        self._check_live(slot)
        child = self._new_slot_id()
        if self.block_manager.has_seq(slot):
            self.block_manager.fork(slot, child)
        self._slots.add(child)
        return child

    def preempt(self, slot: int) -> int:
        """Free ``slot`` to make room; returns the tokens it held (to recompute)."""
        self._check_live(slot)
        self._slots.remove(slot)
        return self.block_manager.preempt(slot) if self.block_manager.has_seq(slot) else 0

    def audit(self) -> list[str]:
        """The block manager's audit plus the pool's own slot bookkeeping."""
        problems = list(self.block_manager.audit())
        for seq_id in self.block_manager.seq_ids():
            if seq_id not in self._slots:
                problems.append(f"block manager holds sequence {seq_id} that is no live slot")
        if self.block_manager.num_blocks != self.num_blocks:
            problems.append(
                f"block manager has {self.block_manager.num_blocks} blocks, tensors have "
                f"{self.num_blocks}"
            )
        return problems

    def reclaim_leaked(self) -> list[int]:
        """Free blocks no page table references (after a bug); returns them."""
        return self.block_manager.reclaim_leaked()

    def stats(self) -> dict[str, float]:
        return self.block_manager.stats().as_dict()

    # -- used by the views -----------------------------------------------------
    def block_table(self, slot: int) -> list[int]:
        """The slot's block ids in token order (empty before its first block)."""
        self._check_live(slot)
        bm = self.block_manager
        return bm.block_table(slot) if bm.has_seq(slot) else []

    def ensure_reserved(self, slot: int, num_tokens: int) -> None:
        """Grow the slot's reservation to ``num_tokens`` (a view writing past
        what ``allocate_slot``/``append_token`` reserved). Raises
        ``OutOfBlocksError`` when the pool is full."""
        self._check_live(slot)
        bm = self.block_manager
        if num_tokens <= 0:
            return
        if not bm.has_seq(slot):
            bm.allocate(slot, num_tokens)
            return
        copies: list[tuple[int, int]] = []
        while bm.seq_len(slot) < num_tokens:
            copies += bm.append(slot)
        self._copy(copies)

    def mark_computed(self, slot: int, num_tokens: int) -> None:
        """Record that the slot's first ``num_tokens`` tokens are written."""
        if num_tokens or self.block_manager.has_seq(slot):
            self.block_manager.mark_computed(slot, num_tokens)

    # -- internals -----------------------------------------------------------
    def _copy(self, pairs: list[tuple[int, int]]) -> None:
        if pairs:
            src_to_dst = torch.tensor(pairs, dtype=torch.int64, device=self.k_cache.device)
            self.ops.copy_blocks(self.k_cache, self.v_cache, src_to_dst)

    def _new_slot_id(self) -> int:
        slot = self._next_slot
        self._next_slot += 1
        return slot

    def _check_live(self, slot: int) -> None:
        if slot not in self._slots:
            raise KeyError(f"slot {slot} is not allocated in this paged pool")
