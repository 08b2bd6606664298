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

    A view covers some sequences; the pass is one flat batch of tokens in
    which each sequence brings a run of consecutive new tokens, starting at
    its cached length. Models call ``update()`` (or ``attend()``) once per
    layer; whoever runs the model calls ``advance()`` once the pass has
    succeeded, which commits the new tokens (nothing is committed before).
    """

    @property
    def seq_len(self) -> int:
        """Tokens already in the cache before this forward pass (the max over
        the view's sequences)."""
        ...

    def update(self, layer_idx: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store the new ``k``/``v`` (``[num_tokens, kv_heads, head_dim]``) for
        ``layer_idx`` and return each sequence's keys/values, cached and new
        (``[num_seqs, kv_heads, max_len, head_dim]``)."""
        ...

    def advance(self, n: int) -> None:
        """Commit the pass: each sequence now holds its new tokens (``n`` is
        used only by views built without per-sequence counts)."""
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
    causal with each sequence's cached-length offset.
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
        """``q``: ``[num_tokens, heads, head_dim]``; ``k``/``v``:
        ``[num_tokens, kv_heads, head_dim]``, the flat batch. Returns
        ``[num_tokens, heads, head_dim]``."""
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
        """A multi-slot view for a packed prefill batch: ``prompt_lens[i]`` new
        tokens of slot ``i``, one slot's tokens after another."""
        ...

    def is_paged(self) -> bool:
        """Whether this pool allocates block by block through page tables."""
        ...


@runtime_checkable
class ServingPoolProtocol(CachePoolProtocol, Protocol):
    """What the engine needs beyond the design documents' pool: prompts with
    prefix-cache hits, room reserved before a step, one flat view per step
    whose metadata is built before the forward pass, commits after it,
    copy-on-write forks and audits. Both backends satisfy it; the contiguous
    one reports no prefix hits and copies a slot's rows to fork."""

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
        """Reserve room for ``token_id``, which a later step writes (and record
        it for prefix hashing). Raises ``OutOfBlocksError`` (a ``RuntimeError``)
        when full, and then changes nothing."""
        ...

    def get_num_reserved(self, slot: int) -> int:
        """Tokens ``slot`` has room for: committed plus reserved ahead."""
        ...

    def step_view(
        self, slots: Sequence[int], starts: Sequence[int], new_lens: Sequence[int]
    ) -> AttentionViewProtocol:
        """The view for one flat step: slot ``i`` computes ``new_lens[i]``
        tokens from position ``starts[i]``, all already reserved. Its metadata
        is complete when this returns, so the forward pass needs no host
        work to learn the layout."""
        ...

    def mark_computed(self, slot: int, num_tokens: int) -> None:
        """Commit: the slot's first ``num_tokens`` tokens are written (their
        full blocks may now serve prefix-cache hits)."""
        ...

    def fork_slot(self, slot: int) -> int:
        """A new slot holding the same tokens (shared copy-on-write blocks
        in the paged pool)."""
        ...

    def audit(self) -> list[str]:
        """Every inconsistency found (empty when healthy)."""
        ...

    def stats(self) -> dict[str, float]:
        """Operator counters: KV usage, prefix-cache queries and hits, evictions
        (preemptions are the engine's to count)."""
        ...
