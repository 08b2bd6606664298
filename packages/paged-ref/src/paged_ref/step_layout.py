"""One step's cache layout, as the scheduler's side hands it to every worker.

The scheduler's KV cache manager decides where each token lives; a worker
only needs the result: each sequence's page table (rows of one host
tensor), where its new tokens start and how many there are, and the block
copies (copy-on-write, forks) to make before the pass reads or writes. The
same object reaches the worker in this process and, pickled, the workers of
the other ranks, so every rank's cache holds its heads of the same tokens
in the same blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(slots=True)
class StepLayout:
    """``block_tables``: ``[batch, width]`` int32 (numpy: cheap to gather and to pickle) (``[groups,
    batch, width]`` for a hybrid cache's KV cache groups), covering every
    token of the step; sequence ``i`` computes ``new_lens[i]`` tokens from
    position ``starts[i]``; ``copies``: ``copy_blocks`` calls to make first,
    in order (each a list of ``(src, dst)`` blocks, read before written);
    ``tier_ops``: the KV tiers' commands (``paged_core.kv_tiers``) to carry
    out before the copies (saves read blocks a later write may reuse)."""

    block_tables: np.ndarray
    starts: list[int]
    new_lens: list[int]
    copies: list[list[tuple[int, int]]] = field(default_factory=list)
    tier_ops: list[tuple[Any, ...]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.new_lens)
