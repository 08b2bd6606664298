"""The two protocol layers every cache backend satisfies.

``KVCacheProtocol`` is what model code sees (a *view* over a pool for one
forward pass); ``CachePoolProtocol`` is what the runner and engine see (the
pool itself). Both the contiguous (slotted) backend and the paged backend
implement them, so nothing above the cache ever checks a cache's type.

paged-core holds no tensors, so tensors are typed as ``Any`` here; the
backends document their shapes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

Tensor = Any  # torch.Tensor in the backends; core stays torch-free.


@runtime_checkable
class KVCacheProtocol(Protocol):
    """A cache view for one forward pass, as model code uses it.

    Models call ``update()`` (or ``attend()``) once per layer, then
    ``advance()`` once per forward pass with the number of new positions.
    """

    @property
    def seq_len(self) -> int:
        """Tokens already in the cache before this forward pass (the max over
        the view's sequences for batched views)."""
        ...

    def update(self, layer_idx: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store the new ``k``/``v`` (``[batch, kv_heads, new_len, head_dim]``)
        for ``layer_idx`` and return the keys/values attention should read."""
        ...

    def advance(self, n: int) -> None:
        """Move the view's sequences forward after a forward pass of ``n``
        (padded) positions; batched views set each sequence's real length."""
        ...

    def is_paged(self) -> bool:
        """Whether the view reads and writes a block-paged pool."""
        ...


@runtime_checkable
class AttentionViewProtocol(KVCacheProtocol, Protocol):
    """A view that also computes attention for the new queries.

    This is the one seam between model code and attention backends: the
    view writes ``k``/``v`` into its pool and runs the backend's attention
    op (reference gather+SDPA or fused Triton) over cached + new context,
    causal with each sequence's cached-length offset, right padding ignored.
    """

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
        """``q``: ``[batch, heads, new_len, head_dim]``; ``k``/``v``:
        ``[batch, kv_heads, new_len, head_dim]``. Returns
        ``[batch, heads, new_len, head_dim]`` (finite zeros at padding)."""
        ...


@runtime_checkable
class CachePoolProtocol(Protocol):
    """A KV cache pool as the runner and engine use it.

    A *slot* is the pool's handle for one sequence: a fixed row of the
    contiguous tensor, or a page table in the paged pool.
    """

    def allocate_slot(self, initial_tokens: int = 0) -> int:
        """Claim a slot with room for ``initial_tokens`` tokens (paged pools
        allocate blocks eagerly; contiguous slots have fixed capacity).

        Raises ``RuntimeError`` when the capacity is not there."""
        ...

    def free_slot(self, slot: int) -> None:
        """Release a slot and everything it holds (blocks, length, table)."""
        ...

    def get_seq_len(self, slot: int) -> int:
        """Tokens currently stored for ``slot``."""
        ...

    def free_slot_count(self) -> int:
        """Free slots (contiguous) or a bound on allocatable sequences (paged)."""
        ...

    def free_token_capacity(self) -> int | None:
        """Tokens that free capacity can still hold; ``None`` where capacity is
        per slot rather than per token (contiguous)."""
        ...

    def prefill_view(self, slot: int) -> KVCacheProtocol:
        """A single-slot view for prefill (new tokens start at the slot's length)."""
        ...

    def decode_view(self, slots: list[int]) -> KVCacheProtocol:
        """A multi-slot view for batched decode (one new token per slot)."""
        ...

    def batched_prefill_view(self, slots: list[int], prompt_lens: list[int]) -> KVCacheProtocol:
        """A multi-slot view for a right-padded prefill batch; ``prompt_lens``
        counts each slot's real new tokens in this pass."""
        ...

    def is_paged(self) -> bool:
        """Whether this pool allocates block by block through page tables."""
        ...


@runtime_checkable
class ServingPoolProtocol(CachePoolProtocol, Protocol):
    """What the engine needs beyond the design documents' pool: prompts with
    prefix-cache hits, growth checked before a decode step, copy-on-write
    forks and audits. Both backends satisfy it; the contiguous one reports
    no prefix hits and copies a slot's rows to fork."""

    def can_allocate_sequence(self, token_ids: Sequence[int]) -> bool:
        """Whether ``allocate_sequence(token_ids)`` would succeed now."""
        ...

    def allocate_sequence(self, token_ids: Sequence[int]) -> tuple[int, int]:
        """Claim a slot for a prompt; returns ``(slot, num_cached_tokens)``.
        The first ``num_cached_tokens`` are already in the cache (prefix hits)
        and the slot's length starts there. Raises ``RuntimeError`` if full."""
        ...

    def can_append(self, slots: Sequence[int]) -> bool:
        """Whether every slot can grow by one token right now."""
        ...

    def append_token(self, slot: int, token_id: int) -> None:
        """Reserve room for ``token_id``, which the next decode step writes
        (and record it for prefix hashing). Raises ``RuntimeError`` if full."""
        ...

    def fork_slot(self, slot: int) -> int:
        """A new slot holding the same tokens (shared copy-on-write blocks
        in the paged pool)."""
        ...

    def audit(self) -> list[str]:
        """Every inconsistency found (empty when healthy)."""
        ...

    def stats(self) -> dict[str, float]:
        """Operator counters: usage, hits, evictions, preemption support."""
        ...
