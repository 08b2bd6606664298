"""The two protocol layers every cache backend satisfies.

``KVCacheProtocol`` is what model code sees (a *view* over a pool for one
forward pass); ``CachePoolProtocol`` is what the runner and engine see (the
pool itself). Both the contiguous backend and the paged backend
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

    Vocabulary, the same in every package: a *seq_id* is the pool's handle
    for one sequence (a row of the contiguous tensor, or a page table in the
    paged pool); a *slot* is one token's place in the cache
    (``slot_mapping``); ``num_computed_tokens`` counts tokens whose K/V are
    written, ``num_reserved`` tokens with room set aside, ``max_model_len``
    the most tokens a sequence may hold. Names other KV-cache APIs
    use for these (``allocate_slot``, ``free_slot``, ``get_seq_len``,
    ``free_slot_count``) are ``allocate_seq``, ``free_seq``, ``get_num_computed_tokens``,
    ``free_seq_count`` here. The views and ``allocate_seq`` are a layer over
    ``ServingPoolProtocol``'s path (``paged_ref.seed_views``), not a second one.
    """

    def allocate_seq(self, initial_tokens: int = 0) -> int:
        """Claim a seq_id with room for ``initial_tokens`` tokens, at least one
        (paged pools allocate blocks eagerly; contiguous rows have fixed capacity).

        Raises ``RuntimeError`` when the capacity is not there."""
        ...

    def free_seq(self, seq_id: int) -> None:
        """Release a seq_id and everything it holds (blocks, length, table)."""
        ...

    def get_num_computed_tokens(self, seq_id: int) -> int:
        """Tokens currently stored for ``seq_id``."""
        ...

    def free_seq_count(self) -> int:
        """Sequences that could be allocated now: free rows (contiguous), or
        free blocks, an upper bound since each sequence needs one (paged)."""
        ...

    def free_token_capacity(self) -> int | None:
        """Tokens that free capacity can still hold; ``None`` where capacity is
        per seq_id rather than per token (contiguous)."""
        ...

    def prefill_view(self, seq_id: int) -> KVCacheProtocol:
        """A single-sequence view for prefill (new tokens start at the seq_id's length)."""
        ...

    def decode_view(self, seq_ids: list[int]) -> KVCacheProtocol:
        """A multi-sequence view for batched decode (one new token per seq_id)."""
        ...

    def batched_prefill_view(self, seq_ids: list[int], prompt_lens: list[int]) -> KVCacheProtocol:
        """A multi-sequence view for a packed prefill batch: ``prompt_lens[i]`` new
        tokens of seq_id ``i``, one seq_id's tokens after another."""
        ...

    def is_paged(self) -> bool:
        """Whether this pool allocates block by block through page tables."""
        ...


@runtime_checkable
class KVCacheManagerProtocol(Protocol):
    """The scheduler's side of a KV cache: which blocks (or rows) each
    sequence holds. Prompts with prefix-cache hits, room reserved before a
    step, the step's layout for the workers, commits after the pass,
    copy-on-write forks and audits; no tensor. ``PagedKVManager`` and
    ``ContiguousKVManager`` satisfy it (the contiguous one reports no prefix
    hits and copies a seq_id's row to fork); each rank's worker holds the
    tensors the layouts address (``paged_ref.kv_tensors``)."""

    def free_seq(self, seq_id: int) -> None:
        """Release a seq_id and everything it holds (blocks, length, table)."""
        ...

    def get_num_computed_tokens(self, seq_id: int) -> int:
        """Tokens currently stored for ``seq_id``."""
        ...

    def free_seq_count(self) -> int:
        """Sequences that could be allocated now: free rows (contiguous), or
        free blocks, an upper bound since each sequence needs one (paged)."""
        ...

    def free_token_capacity(self) -> int | None:
        """Tokens that free capacity can still hold; ``None`` where capacity is
        per seq_id rather than per token (contiguous)."""
        ...

    def is_paged(self) -> bool:
        """Whether blocks are handed out one by one through page tables."""
        ...

    def can_allocate_sequence(
        self, token_ids: Sequence[int], *, skip_prefix_cache: bool = False,
        num_reserved: int | None = None, extra_key: bytes | None = None,
    ) -> bool:  # fmt: skip
        """Whether ``allocate_sequence(token_ids)`` would succeed now."""
        ...

    def can_allocate_sequences(
        self, token_ids: Sequence[Sequence[int]], *, skip_prefix_cache: bool = False,
        num_reserved: int | None = None, extra_key: bytes | None = None,
    ) -> bool:  # fmt: skip
        """Whether every one of them could be allocated now, together (the
        sequences of a beam search are admitted as one unit)."""
        ...

    def allocate_sequence(
        self, token_ids: Sequence[int], *, skip_prefix_cache: bool = False,
        num_reserved: int | None = None, extra_key: bytes | None = None,
    ) -> tuple[int, int]:  # fmt: skip
        """Claim a seq_id for a prompt; returns ``(seq_id, num_cached_tokens)``.
        The first ``num_cached_tokens`` are already in the cache (prefix hits)
        and the seq_id's length starts there; with ``skip_prefix_cache`` it is 0
        (every prompt token is computed, e.g. to score it). Room is reserved
        for every token, or with ``num_reserved`` for at least that many (and
        the hit + 1): ``append_token`` reserves the rest as steps reach it.
        ``extra_key``: what else the KV depends on (a LoRA adapter): a
        prefix hit needs an equal one. Raises ``RuntimeError`` if full."""
        ...

    def can_append(self, seq_ids: Sequence[int]) -> bool:
        """Whether every seq_id can grow by one token right now."""
        ...

    def append_token(self, seq_id: int, token_id: int) -> None:
        """Reserve room for ``token_id``, which a later step writes (and record
        it for prefix hashing). Raises ``OutOfBlocksError`` (a ``RuntimeError``)
        when full, and then changes nothing."""
        ...

    def set_token(self, seq_id: int, position: int, token_id: int) -> None:
        """Give the token ``reserve`` reserved past the known ids (one still
        being sampled while the next step was planned) its id, before that
        token is committed."""
        ...

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        """Give back the room reserved past the first ``num_tokens`` tokens (a
        verify pass's rejected drafts; every computed token is kept)."""
        ...

    def get_num_reserved(self, seq_id: int) -> int:
        """Tokens ``seq_id`` has room for: committed plus reserved ahead."""
        ...

    def reserve(self, seq_id: int, token_ids: Sequence[int], upto: int) -> int:
        """Reserve room for ``token_ids[get_num_reserved(seq_id):upto]`` (the
        sequence's whole history is passed), one token at a time while room
        lasts; returns ``get_num_reserved(seq_id)`` after, short of ``upto``
        when the pool ran out. The scheduler's per-step call: one call per
        sequence, however many tokens it reserves. ``upto`` may pass the end
        of ``token_ids`` by a token still being sampled (``set_token``)."""
        ...

    def step_layout(
        self, seq_ids: Sequence[int], starts: Sequence[int], new_lens: Sequence[int]
    ) -> Any:
        """Where one flat step's tokens go, for every rank's worker
        (``paged_ref.step_layout.StepLayout``: page tables, positions, the
        block copies asked for since the last layout): seq_id ``i`` computes
        ``new_lens[i]`` tokens from position ``starts[i]``, all already
        reserved."""
        ...

    def mark_computed(self, seq_id: int, num_tokens: int) -> None:
        """Commit: the seq_id's first ``num_tokens`` tokens are written (their
        full blocks may now serve prefix-cache hits)."""
        ...

    def fork_seq(self, seq_id: int) -> int:
        """A new seq_id holding the same tokens (shared copy-on-write blocks
        in the paged pool)."""
        ...

    def audit(self) -> list[str]:
        """Every inconsistency found (empty when healthy)."""
        ...

    def reclaim_leaked(self) -> list[int]:
        """Free every block no live seq_id holds (leaked by a bug); returns
        their ids. An operator action after an audit, never run on its own."""
        ...

    def stats(self) -> dict[str, float]:
        """Operator counters: KV usage, prefix-cache queries, hits and misses
        by reason, evictions (preemptions are the engine's to count)."""
        ...


@runtime_checkable
class ServingPoolProtocol(KVCacheManagerProtocol, CachePoolProtocol, Protocol):
    """A whole pool in one process: the KV cache manager joined with its
    tensors (``paged_ref.kv_pool``), so a step's view comes straight from
    it. Tests, benchmarks and the seed views use it; the engine keeps the
    two sides apart."""

    def step_view(
        self, seq_ids: Sequence[int], starts: Sequence[int], new_lens: Sequence[int]
    ) -> AttentionViewProtocol:
        """The view for one flat step: seq_id ``i`` computes ``new_lens[i]``
        tokens from position ``starts[i]``, all already reserved. Its metadata
        is complete when this returns, so the forward pass needs no host
        work to learn the layout."""
        ...
