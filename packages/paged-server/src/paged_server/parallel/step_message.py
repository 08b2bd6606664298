"""What rank 0 tells the other ranks before each forward pass.

Workers keep no block manager: rank 0 schedules, allocates and frees, and
sends each step's layout (page tables, where each sequence starts, how many
tokens it brings) with the token ids. The KV tensors change outside the
forward pass only through ``ops.copy_blocks`` (copy-on-write, contiguous
forks); rank 0 records those calls and sends them along, and a worker
replays them before its forward. So every rank's KV shard holds its heads of
the same tokens in the same blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import numpy as np
import torch


@dataclass(slots=True)
class StepMessage:
    """One forward pass, or ``stop`` (the engine is shutting down)."""

    input_ids: list[int] = field(default_factory=list)
    # [batch, width] int32, the view's rows; [groups, batch, width] for a hybrid pool
    block_tables: np.ndarray | None = None
    starts: list[int] = field(default_factory=list)
    new_lens: list[int] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)  # rows whose logits the engine samples (pipeline)
    copies: list[list[tuple[int, int]]] = field(default_factory=list)  # copy_blocks calls, in order
    stop: bool = False


class RecordingOps:
    """An attention-ops module whose ``copy_blocks`` also records its pairs
    (rank 0's pool uses it; ``take_copies`` hands them to the next message).
    Everything else is the wrapped module's."""

    def __init__(self, ops: ModuleType) -> None:
        self._ops = ops
        self._copies: list[list[tuple[int, int]]] = []  # one list per call

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ops, name)

    def copy_blocks(
        self, k_caches: torch.Tensor, v_caches: torch.Tensor, src_to_dst: Any, **scales: Any
    ) -> None:
        """``scales``: an int8 cache's ``k_scales``/``v_scales`` (workers copy
        their own shard's scales when they replay the pairs)."""
        pairs = torch.as_tensor(src_to_dst, dtype=torch.long).reshape(-1, 2).tolist()
        # Kept per call: a call reads all its sources before writing, so
        # merging two calls could change what a chained copy reads.
        self._copies.append([(int(s), int(d)) for s, d in pairs])
        self._ops.copy_blocks(k_caches, v_caches, src_to_dst, **scales)

    def take_copies(self) -> list[list[tuple[int, int]]]:
        copies, self._copies = self._copies, []
        return copies
