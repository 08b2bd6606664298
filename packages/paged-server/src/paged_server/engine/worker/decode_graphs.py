"""Decode steps replayed from CUDA graphs, one per padded batch size.

On a GPU a decode step of a small model is bound by launching kernels (a few
per layer) from Python, not by the kernels. A CUDA graph records the whole
forward pass once and replays it with one launch. A graph reads fixed
addresses, so a pure-decode step's inputs (token ids, positions, slot
mapping and page tables of every KV cache group, lengths) are copied into
persistent device buffers,
and the batch is padded to the next captured size: padding rows write no KV
(slot -1) and attend to nothing (length 0), and their outputs are dropped.

Everything here also runs without a GPU, eagerly (``capture=False``): the
tests check on a CPU that the padded static-buffer path gives the same
logits as the plain one, and that its forward pass never syncs with the
host or allocates step-dependent shapes (what a capture needs).
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import time
from typing import Any

import torch
from torch import Tensor, nn

from paged_ref.attention_metadata import AttentionMetadata, DecodePart, with_groups
from paged_ref.cache_view import CacheView, ViewPool
from paged_server.engine.worker.graph_safety import GraphSafety

log = logging.getLogger(__name__)

# Batch sizes captured (as vLLM does: small powers of two, then steps of 16).
CAPTURE_SIZES = (1, 2, 4, 8, *range(16, 513, 16))


def capture_sizes(max_batch_size: int) -> list[int]:
    """The captured sizes up to ``max_batch_size`` (which is always one)."""
    return [s for s in CAPTURE_SIZES if s < max_batch_size] + [max_batch_size]


class DecodeGraphs:
    """Static buffers and one graph (or, eagerly, one static view) per size."""

    def __init__(
        self,
        model: nn.Module,
        tensors: ViewPool,
        device: torch.device,
        max_batch_size: int,
        max_blocks_per_seq: int,
        *,
        capture: bool,
        num_groups: int = 1,
        check: bool = False,
    ) -> None:
        self.model = model
        self.check = check  # run each pass under graph_safety.GraphSafety
        self.steps = 0  # decode steps run through the static buffers
        self.tensors = tensors
        self.sizes = capture_sizes(max_batch_size)
        self.capture = capture
        n = self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        # One slot mapping and one set of page tables per KV cache group.
        self.slot_mappings = [
            torch.full((n,), -1, dtype=torch.long, device=device) for _ in range(num_groups)
        ]
        self.block_tables = [
            torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
            for _ in range(num_groups)
        ]
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self._views = {size: self._static_view(size) for size in self.sizes}
        self._graphs: dict[int, Any] = {}
        self._outputs: dict[int, Tensor] = {}

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def padded(self, batch: int) -> int:
        """The captured size a batch of ``batch`` decodes runs at."""
        return self.sizes[bisect.bisect_left(self.sizes, batch)]

    def run(self, meta: AttentionMetadata, input_ids: Tensor) -> Tensor:
        """Hidden states ``[batch, hidden]`` of a pure-decode step (``meta``:
        one token, ``input_ids``, per sequence; ``batch <= max_size``)."""
        batch = len(meta.starts)
        size = self.padded(batch)
        self.steps += 1
        self._load(meta, input_ids, size)
        graph = self._graphs.get(size)
        if graph is not None:
            graph.replay()
            return self._outputs[size][:batch]
        return self._forward(size)[:batch]

    @torch.inference_mode()
    def capture_all(self) -> float:
        """Warm up every size (compiles its kernels) and, with ``capture``,
        record its graph; returns the seconds it took. All-padding inputs:
        nothing is written to or read from the cache."""
        start = time.perf_counter()
        self._reset(self.max_size)
        graph_pool = torch.cuda.graph_pool_handle() if self.capture else None
        for size in reversed(self.sizes):  # largest first: the others reuse its memory
            self._forward(size)
            if self.capture:
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=graph_pool):
                    self._outputs[size] = self._forward(size)
                self._graphs[size] = graph
        seconds = time.perf_counter() - start
        log.info(
            "decode warm-up: %d batch sizes (1..%d) %s in %.1f s",
            len(self.sizes),
            self.max_size,
            "captured as CUDA graphs" if self.capture else "run eagerly",
            seconds,
        )
        return seconds

    # -- internals -------------------------------------------------------------
    def _forward(self, size: int) -> Tensor:
        view = self._views[size]
        assert view.meta is not None
        self.tensors.backend.graph_step(view.meta)  # what it derived last step is stale now
        with GraphSafety() if self.check else contextlib.nullcontext():
            return self.model.hidden_states(  # type: ignore[operator, no-any-return]
                self.input_ids[:size], self.positions[:size], view
            )

    def _static_view(self, size: int) -> CacheView:
        lens = self.seq_lens[:size]
        metas = [
            AttentionMetadata(
                starts=[0] * size,
                new_lens=[1] * size,
                positions=self.positions[:size],
                slot_mapping=slots[:size],
                block_tables=tables[:size],
                seq_lens=lens,
                decode=DecodePart(rows=None, block_tables=tables[:size], seq_lens=lens),
                prefill=None,
            )
            for slots, tables in zip(self.slot_mappings, self.block_tables, strict=True)
        ]
        return CacheView.over(self.tensors, with_groups(metas))

    def _load(self, meta: AttentionMetadata, input_ids: Tensor, size: int) -> None:
        """Device-to-device copies of this step into the static buffers, then padding."""
        batch = len(meta.starts)
        dec = meta.decode
        assert dec is not None and meta.prefill is None, "graphs replay pure-decode steps"
        width = dec.block_tables.shape[1]
        if width > self.block_tables[0].shape[1]:
            raise ValueError(
                f"a sequence uses {width} blocks, more than the {self.block_tables[0].shape[1]} "
                "the graphs were built for (max_model_len / block_size)"
            )
        groups = meta.all_groups()
        if len(groups) != len(self.block_tables):
            raise ValueError(
                f"the step has {len(groups)} KV cache groups but the graphs were built for "
                f"{len(self.block_tables)}"
            )
        self.input_ids[:batch].copy_(input_ids, non_blocking=True)
        self.positions[:batch].copy_(meta.positions, non_blocking=True)
        for group, slots, tables in zip(groups, self.slot_mappings, self.block_tables, strict=True):
            slots[:batch].copy_(group.slot_mapping, non_blocking=True)
            tables[:batch, :width].copy_(group.block_tables, non_blocking=True)
        self.seq_lens[:batch].copy_(dec.seq_lens, non_blocking=True)
        self._reset(size, start=batch)

    def _reset(self, size: int, start: int = 0) -> None:
        """Rows ``start:size`` become padding: no KV write, nothing to attend."""
        if start < size:
            self.input_ids[start:size].zero_()
            self.positions[start:size].zero_()
            for slots in self.slot_mappings:
                slots[start:size].fill_(-1)
            self.seq_lens[start:size].zero_()
