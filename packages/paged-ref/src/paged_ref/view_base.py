"""What every cache view shares: which slots it covers, where each slot's new
tokens start, which padded positions are real, and how ``advance`` commits.

A view covers ``slots``; slot ``i``'s new tokens start at its current length
``starts[i]`` (non-zero after prefix hits, earlier chunks or in decode) and
``new_lens[i]`` of the ``padded_len`` positions in the forward pass are real
(``None``: all of them). The slotted and the paged views differ only in how
they store and read K/V, so this bookkeeping lives here once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(slots=True)
class TokenLayout:
    """Per-step index tensors for a right-padded batch, built once per view.

    ``batch_idx``/``tok_idx`` list the real tokens (row-major); ``positions``
    are their absolute positions in their sequence.
    """

    starts: list[int]
    new_lens: list[int]
    padded_len: int
    batch_idx: Tensor  # [num_real] long
    tok_idx: Tensor  # [num_real] long
    positions: Tensor  # [num_real] long
    q_positions: Tensor  # [batch, padded_len] long
    q_valid: Tensor  # [batch, padded_len] bool
    kv_lens: Tensor  # [batch] long: starts + new_lens

    @property
    def num_real(self) -> int:
        return sum(self.new_lens)

    @property
    def all_fresh(self) -> bool:
        """No slot has cached context: attention needs only this pass's K/V."""
        return all(s == 0 for s in self.starts)

    @property
    def is_decode(self) -> bool:
        """Exactly one real token per slot (the decode op's shape)."""
        return self.padded_len == 1 and all(n == 1 for n in self.new_lens)

    @property
    def max_end(self) -> int:
        """Key positions a gathered cache must cover: ``max(start) + padded_len``."""
        return max(self.starts, default=0) + self.padded_len


def build_layout(
    starts: list[int], new_lens: list[int], padded_len: int, device: torch.device
) -> TokenLayout:
    """Index tensors for slots starting at ``starts`` with ``new_lens`` real tokens."""
    batch = len(starts)
    start_t = torch.tensor(starts, dtype=torch.long, device=device)
    len_t = torch.tensor(new_lens, dtype=torch.long, device=device)
    cols = torch.arange(padded_len, device=device).unsqueeze(0)
    q_valid = cols < len_t.unsqueeze(1)
    batch_idx = torch.arange(batch, device=device).unsqueeze(1).expand(batch, padded_len)[q_valid]
    tok_idx = cols.expand(batch, padded_len)[q_valid]
    return TokenLayout(
        starts=list(starts),
        new_lens=list(new_lens),
        padded_len=padded_len,
        batch_idx=batch_idx,
        tok_idx=tok_idx,
        positions=start_t[batch_idx] + tok_idx,
        q_positions=start_t.unsqueeze(1) + cols,
        q_valid=q_valid,
        kv_lens=start_t + len_t,
    )


class CacheViewBase:
    """Slots, start offsets, real lengths and ``advance`` for one forward pass.

    Subclasses store/read K/V and implement :meth:`_commit` (record a slot's
    new length in the pool) and :meth:`_prepare` (per-step metadata, called
    once when the layout is first built, i.e. on the first layer).
    """

    def __init__(
        self, slots: Sequence[int], starts: Sequence[int], new_lens: Sequence[int] | None
    ) -> None:
        if len(set(slots)) != len(slots):
            raise ValueError(f"a view must cover distinct slots, got {list(slots)}")
        if new_lens is not None:
            if len(new_lens) != len(slots):
                raise ValueError(f"got {len(new_lens)} new lengths for {len(slots)} slots")
            if any(n < 0 for n in new_lens):
                raise ValueError(f"new token counts must be >= 0, got {list(new_lens)}")
        self.slots = list(slots)
        self.starts = list(starts)
        self.new_lens = None if new_lens is None else list(new_lens)
        self._layout: TokenLayout | None = None

    @property
    def seq_len(self) -> int:
        """Tokens cached before this pass (the max over the view's slots)."""
        return max(self.starts, default=0)

    def layout(self, padded_len: int, device: torch.device) -> TokenLayout:
        """This pass's layout, built on first use (layer 0) and then reused."""
        if self._layout is None:
            lens = self.new_lens if self.new_lens is not None else [padded_len] * len(self.slots)
            if any(n > padded_len for n in lens):
                raise ValueError(
                    f"real token counts {lens} exceed the padded length {padded_len} of k/v"
                )
            self._layout = build_layout(self.starts, lens, padded_len, device)
            self._prepare(self._layout)
        elif self._layout.padded_len != padded_len:
            raise ValueError(
                f"k/v have {padded_len} positions but earlier layers of this pass had "
                f"{self._layout.padded_len}; use one view per forward pass"
            )
        return self._layout

    def advance(self, n: int) -> None:
        """Commit this pass: each slot grows by its real new token count
        (``new_lens[i]``, or ``n`` when the view was built without them)."""
        added = self.new_lens if self.new_lens is not None else [n] * len(self.slots)
        for slot, start, extra in zip(self.slots, self.starts, added, strict=True):
            self._commit(slot, start + extra)
        self.starts = [s + a for s, a in zip(self.starts, added, strict=True)]
        self.new_lens = None
        self._layout = None

    def _prepare(self, layout: TokenLayout) -> None:
        """Per-step metadata hook; the default needs none."""

    def _commit(self, slot: int, new_len: int) -> None:
        raise NotImplementedError
