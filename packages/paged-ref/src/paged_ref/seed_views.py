"""The seed pool API (``CachePoolProtocol``) as a thin layer over the engine's path.

``allocate_seq``, ``prefill_view``, ``decode_view`` and ``batched_prefill_view``
(``CachePoolProtocol``) are the project's public contract, but the engine
reserves room with ``allocate_sequence`` / ``append_token`` and runs each
step through ``step_view``. This layer is built from those calls only, so the
pools keep one path: a seq_id always holds at least one reserved token and
every reserved token an id.

These views see K/V, never token ids: they reserve with ``UNKNOWN_TOKEN``.
No prompt holds a negative id, and they skip the prefix-cache lookup, so such
blocks never serve a prefix hit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor

from paged_ref.cache_view import CacheView

UNKNOWN_TOKEN = -1


class SeedView:
    """A view that starts at each seq_id's committed length and reserves
    its own room before each pass; ``new_lens=None`` (one seq_id) takes
    each pass's token count from its ``k``. Commits on ``advance``, after
    which it can run the next pass with the same counts (e.g. decode)."""

    def __init__(self, pool: Any, seq_ids: Sequence[int], new_lens: Sequence[int] | None) -> None:
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"a view must cover distinct seq_ids, got {list(seq_ids)}")
        if new_lens is None and len(seq_ids) != 1:
            raise ValueError("a view without token counts must cover exactly one seq_id")
        self.pool, self.seq_ids = pool, list(seq_ids)
        self.starts = [pool.get_num_computed_tokens(s) for s in self.seq_ids]
        self.new_lens = None if new_lens is None else list(new_lens)
        self._open = new_lens is None
        self.step: CacheView | None = None
        if new_lens is not None:
            self._pass(0)

    @property
    def seq_len(self) -> int:
        return max(self.starts, default=0)

    @property
    def meta(self) -> Any:
        """The current pass's metadata (None before an open view's first layer)."""
        return None if self.step is None else self.step.meta

    def is_paged(self) -> bool:
        return bool(self.pool.is_paged())

    def update(self, layer_idx: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        return self._pass(k.shape[0]).update(layer_idx, k, v)

    def attend(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor, **kwargs: Any) -> Tensor:
        return self._pass(k.shape[0]).attend(layer_idx, q, k, v, **kwargs)

    def advance(self, n: int | None = None) -> None:
        """Commit: seq_id ``i`` holds ``starts[i] + new_lens[i]`` tokens (``n``
        each for an open view that ran no pass)."""
        added = self.new_lens if self.new_lens is not None else [n or 0] * len(self.seq_ids)
        for seq_id, start, extra in zip(self.seq_ids, self.starts, added, strict=True):
            self.pool.mark_computed(seq_id, start + extra)
        self.starts = [s + a for s, a in zip(self.starts, added, strict=True)]
        self.step = None
        if self._open:
            self.new_lens = None

    def _pass(self, num_tokens: int) -> CacheView:
        """This pass's step view, reserving room for its tokens first."""
        if self.step is None:
            lens = self.new_lens = self.new_lens if self.new_lens is not None else [num_tokens]
            for seq_id, start, n in zip(self.seq_ids, self.starts, lens, strict=True):
                while self.pool.get_num_reserved(seq_id) < start + n:
                    self.pool.append_token(seq_id, UNKNOWN_TOKEN)
            self.step = self.pool.step_view(self.seq_ids, self.starts, lens)
        return self.step


class SeedViews:
    """``CachePoolProtocol``'s allocation and views, for a pool that also
    satisfies ``ServingPoolProtocol`` (both pools mix this in)."""

    def allocate_seq(self, initial_tokens: int = 0) -> int:
        """A seq_id with room for ``initial_tokens`` tokens (at least one),
        taken now so that a full pool fails here, before any forward pass."""
        if initial_tokens < 0:
            raise ValueError(f"initial_tokens must be >= 0, got {initial_tokens}")
        seq_id, _ = self.allocate_sequence(  # type: ignore[attr-defined]
            [UNKNOWN_TOKEN] * max(initial_tokens, 1), skip_prefix_cache=True
        )
        return int(seq_id)

    def prefill_view(self, seq_id: int) -> SeedView:
        """One seq_id; each pass's token count comes from its ``k``."""
        return SeedView(self, [seq_id], None)

    def decode_view(self, seq_ids: list[int]) -> SeedView:
        """One new token per seq_id at its current length."""
        return SeedView(self, seq_ids, [1] * len(seq_ids))

    def batched_prefill_view(self, seq_ids: list[int], prompt_lens: list[int]) -> SeedView:
        """``prompt_lens[i]`` new tokens for seq_id ``i``, packed one after another."""
        return SeedView(self, seq_ids, prompt_lens)

    def view(self, seq_ids: Sequence[int], new_lens: Sequence[int] | None = None) -> SeedView:
        """``new_lens[i]`` new tokens for seq_id ``i`` at its length (one seq_id
        without counts: as ``prefill_view``)."""
        return SeedView(self, seq_ids, new_lens)
