"""Contiguous KV cache pool: one fixed ``max_seq_len`` row per slot.

The baseline the paged pool is measured against: every slot reserves
``max_seq_len`` positions up front, so capacity is per slot, not per token.
It satisfies ``ServingPoolProtocol`` with no prefix cache (always 0 cached
tokens) and forks by copying rows.

Its tensors have the paged pool's layout with one block per slot
(``[layers, slots, max_seq_len, kv_heads, head_dim]``: block id = slot,
block size = ``max_seq_len``), so both pools share one view class and one
set of attention ops; only the bookkeeping differs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from paged_core import OutOfBlocksError
from paged_ref import ops as ref_ops
from paged_ref.attention_metadata import AttentionMetadata, build_metadata
from paged_ref.cache_view import ViewsMixin


class SlottedKVCache(ViewsMixin):
    """``k_cache``/``v_cache``: ``[layers, max_batch_size, max_seq_len, kv_heads, head_dim]``.

    ``seq_lens[slot]`` counts tokens written (what views attend over);
    ``reserved[slot]`` counts tokens promised by ``allocate_sequence`` and
    ``append_token`` (always >= ``seq_lens[slot]``, at most ``max_seq_len``).
    """

    def __init__(self, k_cache: Tensor, v_cache: Tensor) -> None:
        if k_cache.shape != v_cache.shape or k_cache.dim() != 5:
            raise ValueError(
                "k_cache and v_cache must both be [layers, max_batch_size, max_seq_len, "
                f"kv_heads, head_dim], got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
            )
        self.k_cache = k_cache
        self.v_cache = v_cache
        self.num_layers, self.max_batch_size, self.max_seq_len, self.num_kv_heads, self.head_dim = (
            k_cache.shape
        )
        self.ops = ref_ops  # the contiguous baseline always attends with the reference ops
        self.seq_lens: list[int] = [0] * self.max_batch_size
        self.reserved: list[int] = [0] * self.max_batch_size
        self._free: set[int] = set(range(self.max_batch_size))

    @staticmethod
    def from_model_config(
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        max_seq_len: int,
        max_batch_size: int,
        *,
        dtype: torch.dtype = torch.bfloat16,
        device: str | torch.device = "cpu",
    ) -> SlottedKVCache:
        """A zeroed pool for a model's shape (pass ``device="meta"`` to size it
        without allocating memory)."""
        shape = (num_layers, max_batch_size, max_seq_len, num_kv_heads, head_dim)
        return SlottedKVCache(
            torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device),
        )

    # Design-document names for the two tensors.
    @property
    def k(self) -> Tensor:
        return self.k_cache

    @property
    def v(self) -> Tensor:
        return self.v_cache

    def kv_bytes(self) -> int:
        """Bytes held by the K and V tensors together."""
        return sum(t.numel() * t.element_size() for t in (self.k_cache, self.v_cache))

    # -- CachePoolProtocol -------------------------------------------------
    def allocate_slot(self, initial_tokens: int = 0) -> int:
        """Claim a free slot (``initial_tokens`` is only checked against
        ``max_seq_len``: a slot's capacity is fixed)."""
        self._check_fits(initial_tokens)
        if not self._free:
            raise OutOfBlocksError(
                f"all {self.max_batch_size} cache slots are in use; free a slot first "
                "or build the pool with a larger max_batch_size"
            )
        slot = min(self._free)  # lowest first: deterministic, easy to read in logs
        self._free.remove(slot)
        self.seq_lens[slot] = 0
        self.reserved[slot] = initial_tokens
        return slot

    def free_slot(self, slot: int) -> None:
        """Release ``slot``; its stale rows stay but are never read (lengths reset)."""
        self._check_allocated(slot)
        self.seq_lens[slot] = 0
        self.reserved[slot] = 0
        self._free.add(slot)

    def get_seq_len(self, slot: int) -> int:
        self._check_allocated(slot)
        return self.seq_lens[slot]

    def free_slot_count(self) -> int:
        return len(self._free)

    def free_token_capacity(self) -> int | None:
        """``None``: capacity is per slot, not per token."""
        return None

    def is_paged(self) -> bool:
        return False

    # -- ServingPoolProtocol -------------------------------------------------
    def can_allocate_sequence(self, token_ids: Sequence[int]) -> bool:
        return bool(self._free) and len(token_ids) <= self.max_seq_len

    def allocate_sequence(self, token_ids: Sequence[int]) -> tuple[int, int]:
        """A slot for the prompt; no prefix cache, so 0 tokens are cached."""
        return self.allocate_slot(len(token_ids)), 0

    def can_append(self, slots: Sequence[int]) -> bool:
        return all(self.reserved[s] < self.max_seq_len for s in slots)

    def append_token(self, slot: int, token_id: int) -> None:
        """Reserve the next position of ``slot`` (the token id is not needed:
        no prefix hashing here)."""
        self._check_allocated(slot)
        if self.reserved[slot] >= self.max_seq_len:
            raise OutOfBlocksError(
                f"slot {slot} is full ({self.max_seq_len} tokens = max_seq_len); "
                "finish or preempt the sequence"
            )
        self.reserved[slot] += 1

    def get_num_reserved(self, slot: int) -> int:
        """Tokens the slot has room promised for (at most ``max_seq_len``)."""
        self._check_allocated(slot)
        return max(self.reserved[slot], self.seq_lens[slot])

    def fork_slot(self, slot: int) -> int:
        """A new slot holding a copy of ``slot``'s written rows."""
        self._check_allocated(slot)
        child = self.allocate_slot(self.reserved[slot])
        n = self.seq_lens[slot]
        self.k_cache[:, child, :n] = self.k_cache[:, slot, :n]
        self.v_cache[:, child, :n] = self.v_cache[:, slot, :n]
        self.seq_lens[child] = n
        return child

    def mark_computed(self, slot: int, num_tokens: int) -> None:
        """Commit: the slot holds ``num_tokens`` written tokens."""
        self.set_seq_len(slot, num_tokens)

    def audit(self) -> list[str]:
        problems = []
        for slot in range(self.max_batch_size):
            n, r = self.seq_lens[slot], self.reserved[slot]
            if slot in self._free:
                if n or r:
                    problems.append(f"free slot {slot} still has seq_len {n}, reserved {r}")
            elif not 0 <= n <= self.max_seq_len:
                problems.append(f"slot {slot} seq_len {n} is outside 0..{self.max_seq_len}")
            elif r > self.max_seq_len:
                problems.append(f"slot {slot} reserved {r} > max_seq_len {self.max_seq_len}")
        return problems

    def stats(self) -> dict[str, float]:
        """Usage counters under the block manager's names where they mean the
        same: ``usage`` = tokens held / (slots x max_seq_len); no prefix cache."""
        used = self.max_batch_size - len(self._free)
        held = sum(max(n, r) for n, r in zip(self.seq_lens, self.reserved, strict=True))
        capacity = self.max_batch_size * self.max_seq_len
        return {
            "usage": held / capacity if capacity else 0.0,
            "tokens_used": float(held),
            "token_capacity": float(capacity),
            "slots_used": float(used),
            "slots_total": float(self.max_batch_size),
            "hit_rate": 0.0,
        }

    # -- used by the views -----------------------------------------------------
    def build_metadata(
        self, slots: Sequence[int], starts: Sequence[int], new_lens: Sequence[int], reserve: bool
    ) -> AttentionMetadata:
        """Step metadata with one "block" per slot: the slot's whole row."""
        for slot, start, n in zip(slots, starts, new_lens, strict=True):
            self._check_allocated(slot)
            end = start + n
            self._check_fits(end)
            if reserve:
                self.reserved[slot] = max(self.reserved[slot], end)
            elif end > self.get_num_reserved(slot):
                raise RuntimeError(
                    f"slot {slot} has room for {self.get_num_reserved(slot)} tokens but this "
                    f"step writes up to position {end - 1}; reserve first (append_token)"
                )
        tables = torch.tensor(list(slots), dtype=torch.int32).view(-1, 1)
        return build_metadata(tables, starts, new_lens, self.max_seq_len, self.k_cache.device)

    def set_seq_len(self, slot: int, n: int) -> None:
        """Record that ``slot`` now holds ``n`` written tokens."""
        self._check_fits(n)
        self.seq_lens[slot] = n
        self.reserved[slot] = max(self.reserved[slot], n)

    def _check_fits(self, n: int) -> None:
        if n > self.max_seq_len:
            raise ValueError(
                f"{n} tokens do not fit a slot of max_seq_len {self.max_seq_len}; "
                "shorten the prompt or build the pool with a larger max_seq_len"
            )

    def _check_allocated(self, slot: int) -> None:
        if not 0 <= slot < self.max_batch_size or slot in self._free:
            raise KeyError(f"slot {slot} is not allocated in this pool")
