"""A whole KV cache pool in one process: the scheduler's side and the worker's side joined.

``KVPool`` pairs a KV cache manager (``PagedKVManager`` or
``ContiguousKVManager``: which blocks each sequence holds) with the
``KVCacheTensors`` it describes, and satisfies ``ServingPoolProtocol``:
the manager answers every call about capacity and sequences, and
``step_view`` joins the two (the manager's ``StepLayout``, the tensors'
view over it, committing back to the manager). The seed pool
API (``CachePoolProtocol``: ``allocate_seq``, ``prefill_view``...) is the thin layer ``SeedViews``
over it. The engine keeps the two sides apart (the manager beside its
scheduler, the tensors in each rank's worker); tests, benchmarks and the
calibration pass use the joined pool.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor

from paged_core.attention_backend import AttentionBackend
from paged_ref.attention_metadata import AttentionMetadata
from paged_ref.cache_view import CacheView
from paged_ref.kv_tensors import KVCacheTensors
from paged_ref.seed_views import SeedViews
from paged_ref.step_layout import StepLayout


class KVPool(SeedViews):
    """``manager`` + ``tensors`` (see module doc)."""

    def __init__(self, manager: Any, tensors: KVCacheTensors) -> None:
        if manager.block_size != tensors.block_size:
            raise ValueError(
                f"the manager's blocks hold {manager.block_size} tokens, the tensors' {tensors.block_size}"
            )
        self.manager = manager
        self.tensors = tensors

    # -- the tensors, as the views and the ops name them ------------------------
    @property
    def k_cache(self) -> Tensor:
        return self.tensors.k_cache

    @property
    def v_cache(self) -> Tensor:
        return self.tensors.v_cache

    @property
    def k_scales(self) -> Tensor | None:
        return self.tensors.k_scales

    @property
    def v_scales(self) -> Tensor | None:
        return self.tensors.v_scales

    @property
    def k_head_scales(self) -> Tensor | None:
        return self.tensors.k_head_scales

    @property
    def v_head_scales(self) -> Tensor | None:
        return self.tensors.v_head_scales

    @property
    def ops(self) -> Any:
        return self.tensors.ops

    @property
    def backend(self) -> AttentionBackend:
        return self.tensors.backend

    @property
    def block_size(self) -> int:
        return int(self.tensors.block_size)

    def kv_bytes(self) -> int:
        return self.tensors.kv_bytes()

    def locate_layer(self, layer_idx: int) -> tuple[int, int, int | None]:
        return self.tensors.locate_layer(layer_idx)

    def is_paged(self) -> bool:
        return self.tensors.is_paged()

    # -- ServingPoolProtocol: the manager's answers ------------------------------
    def free_seq(self, seq_id: int) -> None:
        self.manager.free_seq(seq_id)

    def get_num_computed_tokens(self, seq_id: int) -> int:
        return int(self.manager.get_num_computed_tokens(seq_id))

    def free_seq_count(self) -> int:
        return int(self.manager.free_seq_count())

    def free_token_capacity(self) -> int | None:
        return self.manager.free_token_capacity()  # type: ignore[no-any-return]

    def can_allocate_sequence(self, token_ids: Sequence[int], **kwargs: Any) -> bool:
        return bool(self.manager.can_allocate_sequence(token_ids, **kwargs))

    def can_allocate_sequences(self, token_ids: Sequence[Sequence[int]], **kwargs: Any) -> bool:
        return bool(self.manager.can_allocate_sequences(token_ids, **kwargs))

    def allocate_sequence(self, token_ids: Sequence[int], **kwargs: Any) -> tuple[int, int]:
        return self.manager.allocate_sequence(token_ids, **kwargs)  # type: ignore[no-any-return]

    def can_append(self, seq_ids: Sequence[int]) -> bool:
        return bool(self.manager.can_append(seq_ids))

    def append_token(self, seq_id: int, token_id: int) -> None:
        self.manager.append_token(seq_id, token_id)

    def get_num_reserved(self, seq_id: int) -> int:
        return int(self.manager.get_num_reserved(seq_id))

    def reserve(self, seq_id: int, token_ids: Sequence[int], upto: int) -> int:
        return int(self.manager.reserve(seq_id, token_ids, upto))

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        self.manager.truncate(seq_id, num_tokens)

    def set_token(self, seq_id: int, position: int, token_id: int) -> None:
        self.manager.set_token(seq_id, position, token_id)

    def fork_seq(self, seq_id: int) -> int:
        """The manager's fork; a joined pool makes its block copies at once."""
        child = int(self.manager.fork_seq(seq_id))
        for pairs in self.manager.take_copies():
            self.tensors.copy_blocks(pairs)
        return child

    def mark_computed(self, seq_id: int, num_tokens: int) -> None:
        self.manager.mark_computed(seq_id, num_tokens)

    def audit(self) -> list[str]:
        return list(self.manager.audit())

    def reclaim_leaked(self) -> list[int]:
        return list(self.manager.reclaim_leaked())

    def stats(self) -> dict[str, float]:
        return dict(self.manager.stats())

    def step_layout(self, seq_ids: Sequence[int], starts: Sequence[int], new_lens: Sequence[int]) -> StepLayout:
        return self.manager.step_layout(seq_ids, starts, new_lens)  # type: ignore[no-any-return]

    # -- each step: the two sides joined -------------------------------------------
    def build_metadata(
        self, seq_ids: Sequence[int], starts: Sequence[int], new_lens: Sequence[int]
    ) -> AttentionMetadata:
        """A step's metadata over the tensors, its block copies made first."""
        return self.tensors.metadata(self.manager.step_layout(seq_ids, starts, new_lens))

    def step_view(
        self, seq_ids: Sequence[int], starts: Sequence[int], new_lens: Sequence[int]
    ) -> CacheView:
        """The view for one engine step: seq_id ``i`` computes ``new_lens[i]``
        tokens from position ``starts[i]``, all of them already reserved. Its
        metadata is complete before the forward pass starts; ``advance``
        commits to the manager."""
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"a view must cover distinct seq_ids, got {list(seq_ids)}")
        if len(new_lens) != len(seq_ids) or min(new_lens, default=0) < 0:
            raise ValueError(f"need a new token count >= 0 per seq_id, got {list(new_lens)} for {list(seq_ids)}")
        meta = self.build_metadata(seq_ids, starts, new_lens)
        return CacheView(self.tensors, meta, seq_ids, committer=self.manager)
