"""The scheduler's side of the contiguous KV cache: one fixed ``max_model_len`` row per seq_id.

The baseline the paged cache is measured against: every seq_id reserves
``max_model_len`` positions up front, so capacity is per seq_id, not per
token. ``ContiguousKVManager`` keeps which rows are taken and how many
tokens each holds and has room for; its ``StepLayout`` gives each seq_id
one "block" (its row, block id = seq_id, block size = ``max_model_len``),
so the workers' tensors, views and ops are the paged cache's. No prefix
cache (always 0 cached tokens); a fork copies the row, as a block copy the
next layout carries.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from paged_core import OutOfBlocksError
from paged_ref.step_layout import StepLayout


class ContiguousKVManager:
    """``max_batch_size`` rows of ``max_model_len`` tokens; satisfies
    ``KVCacheManagerProtocol``.

    ``seq_lens[seq_id]`` counts tokens written (what views attend over);
    ``reserved[seq_id]`` counts tokens promised by ``allocate_sequence`` and
    ``append_token`` (always >= ``seq_lens[seq_id]``, at most ``max_model_len``).
    """

    def __init__(self, max_batch_size: int, max_model_len: int) -> None:
        self.max_batch_size = max_batch_size
        self.max_model_len = max_model_len
        self.block_size = max_model_len  # one block per row
        self.seq_lens: list[int] = [0] * max_batch_size
        self.reserved: list[int] = [0] * max_batch_size
        self._free: set[int] = set(range(max_batch_size))
        self._pending_copies: list[list[tuple[int, int]]] = []

    def is_paged(self) -> bool:
        return False

    # -- capacity ------------------------------------------------------------
    def free_seq(self, seq_id: int) -> None:
        """Release ``seq_id``; its stale rows stay but are never read (lengths reset)."""
        self._check_live(seq_id)
        self.seq_lens[seq_id] = 0
        self.reserved[seq_id] = 0
        self._free.add(seq_id)

    def get_num_computed_tokens(self, seq_id: int) -> int:
        self._check_live(seq_id)
        return self.seq_lens[seq_id]

    def free_seq_count(self) -> int:
        return len(self._free)

    def free_token_capacity(self) -> int | None:
        """``None``: capacity is per seq_id, not per token."""
        return None

    def can_allocate_sequence(
        self, token_ids: Sequence[int], *, skip_prefix_cache: bool = False,
        num_reserved: int | None = None, extra_key: bytes | None = None,
    ) -> bool:  # fmt: skip
        return self.can_allocate_sequences([token_ids])

    def can_allocate_sequences(
        self, token_ids: Sequence[Sequence[int]], *, skip_prefix_cache: bool = False,
        num_reserved: int | None = None, extra_key: bytes | None = None,
    ) -> bool:  # fmt: skip
        """One free row each, every one long enough."""
        return len(self._free) >= len(token_ids) and all(
            len(t) <= self.max_model_len for t in token_ids
        )

    def allocate_sequence(
        self, token_ids: Sequence[int], *, skip_prefix_cache: bool = False,
        num_reserved: int | None = None, extra_key: bytes | None = None,
    ) -> tuple[int, int]:  # fmt: skip
        """A free seq_id (lowest first: deterministic, easy to read in logs)
        for the prompt; no prefix cache, so 0 tokens are cached. The row holds
        every token, so all are reserved (``num_reserved`` is a lower bound a
        pool may exceed)."""
        self._check_fits(len(token_ids))
        if not self._free:
            raise OutOfBlocksError(
                f"all {self.max_batch_size} cache seq_ids are in use; free a seq_id first "
                "or build the pool with a larger max_batch_size"
            )
        seq_id = min(self._free)
        self._free.remove(seq_id)
        self.seq_lens[seq_id], self.reserved[seq_id] = 0, len(token_ids)
        return seq_id, 0

    def can_append(self, seq_ids: Sequence[int]) -> bool:
        return all(self.reserved[s] < self.max_model_len for s in seq_ids)

    def append_token(self, seq_id: int, token_id: int) -> None:
        """Reserve the next position of ``seq_id`` (the token id is not needed:
        no prefix hashing here)."""
        self._check_live(seq_id)
        if self.reserved[seq_id] >= self.max_model_len:
            raise OutOfBlocksError(
                f"seq_id {seq_id} is full ({self.max_model_len} tokens = max_model_len); "
                "finish or preempt the sequence"
            )
        self.reserved[seq_id] += 1

    def get_num_reserved(self, seq_id: int) -> int:
        """Tokens the seq_id has room promised for (at most ``max_model_len``)."""
        self._check_live(seq_id)
        return max(self.reserved[seq_id], self.seq_lens[seq_id])

    def reserve(self, seq_id: int, token_ids: Sequence[int], upto: int) -> int:
        """Room up to ``upto`` tokens, at most ``max_model_len`` (the row's end)."""
        reserved = self.get_num_reserved(seq_id)
        if upto > reserved:
            reserved = self.reserved[seq_id] = min(upto, self.max_model_len)
        return reserved

    def set_token(self, seq_id: int, position: int, token_id: int) -> None:
        """Token ids are not kept here (no prefix cache): nothing to do."""

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        """Room promised past ``num_tokens`` tokens goes (the row stays)."""
        self._check_live(seq_id)
        if not self.seq_lens[seq_id] <= num_tokens <= self.get_num_reserved(seq_id):
            raise ValueError(
                f"seq_id {seq_id} holds {self.seq_lens[seq_id]} of {self.get_num_reserved(seq_id)} "
                f"reserved tokens; cannot keep {num_tokens}"
            )
        self.reserved[seq_id] = num_tokens

    def fork_seq(self, seq_id: int) -> int:
        """A new seq_id whose row is a copy of ``seq_id``'s (made, as a block
        copy, before the next step reads or writes the cache)."""
        self._check_live(seq_id)
        child, _ = self.allocate_sequence([0] * self.get_num_reserved(seq_id))
        self._pending_copies.append([(seq_id, child)])
        self.seq_lens[child] = self.seq_lens[seq_id]
        return child

    def mark_computed(self, seq_id: int, num_tokens: int) -> None:
        """Commit: the seq_id holds ``num_tokens`` written tokens."""
        self._check_fits(num_tokens)
        self.seq_lens[seq_id] = num_tokens
        self.reserved[seq_id] = max(self.reserved[seq_id], num_tokens)

    # -- operators -------------------------------------------------------------
    def audit(self) -> list[str]:
        problems = []
        for seq_id in range(self.max_batch_size):
            n, r = self.seq_lens[seq_id], self.reserved[seq_id]
            if seq_id in self._free:
                if n or r:
                    problems.append(f"free seq_id {seq_id} still has seq_len {n}, reserved {r}")
            elif not 0 <= n <= self.max_model_len:
                problems.append(f"seq_id {seq_id} seq_len {n} is outside 0..{self.max_model_len}")
            elif r > self.max_model_len:
                problems.append(f"seq_id {seq_id} reserved {r} > max_model_len {self.max_model_len}")
        return problems

    def reclaim_leaked(self) -> list[int]:
        """Nothing to reclaim: rows are not shared, and a seq_id is freed by
        whoever allocated it (an idle engine's audit reports one still held)."""
        return []

    def stats(self) -> dict[str, float]:
        """Usage counters under the block manager's names where they mean the
        same: ``usage`` = tokens held / (seq_ids x max_model_len); no prefix cache."""
        used = self.max_batch_size - len(self._free)
        held = sum(max(n, r) for n, r in zip(self.seq_lens, self.reserved, strict=True))
        capacity = self.max_batch_size * self.max_model_len
        return {
            "usage": held / capacity if capacity else 0.0,
            "tokens_used": float(held),
            "token_capacity": float(capacity),
            "rows_used": float(used),
            "rows_total": float(self.max_batch_size),
            "hit_rate": 0.0,
        }

    # -- each step ---------------------------------------------------------------
    def step_layout(
        self, seq_ids: Sequence[int], starts: Sequence[int], new_lens: Sequence[int]
    ) -> StepLayout:
        """One "block" per seq_id: the seq_id's whole row; forks' row copies first."""
        for seq_id, start, n in zip(seq_ids, starts, new_lens, strict=True):
            self._check_live(seq_id)
            end = start + n
            self._check_fits(end)
            if end > self.get_num_reserved(seq_id):
                raise RuntimeError(
                    f"seq_id {seq_id} has room for {self.get_num_reserved(seq_id)} tokens but this "
                    f"step writes up to position {end - 1}; reserve first (append_token)"
                )
        tables = np.array(seq_ids, dtype=np.int32).reshape(-1, 1)
        return StepLayout(tables, list(starts), list(new_lens), self.take_copies())

    def take_copies(self) -> list[list[tuple[int, int]]]:
        """The row copies forks asked for since the last call, in order."""
        copies, self._pending_copies = self._pending_copies, []
        return copies

    # -- internals -----------------------------------------------------------
    def _check_fits(self, n: int) -> None:
        if n > self.max_model_len:
            raise ValueError(
                f"{n} tokens do not fit a seq_id of max_model_len {self.max_model_len}; "
                "shorten the prompt or build the pool with a larger max_model_len"
            )

    def _check_live(self, seq_id: int) -> None:
        if not 0 <= seq_id < self.max_batch_size or seq_id in self._free:
            raise KeyError(f"seq_id {seq_id} is not allocated in this pool")
