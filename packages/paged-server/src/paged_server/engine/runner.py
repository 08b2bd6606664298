"""Model runner: one flat forward pass per step.

Every token the scheduler picked, of every sequence, goes into one
``[num_tokens]`` batch with no padding: sequences with one new token
(decodes) first, then prefill chunks, so the attention ops get each part as
a contiguous run of rows. The pool's ``step_view`` builds the step's
metadata (page tables, slot mapping, lengths) before the forward pass, and
the LM head runs only on the rows whose logits are sampled: the last token
of each sequence whose tokens are all computed after this step, plus, for a
request that asked for ``prompt_logprobs``, the prompt rows whose next
prompt token is not scored yet.

With pipeline parallelism (``pipeline``) rank 0 runs only the first
stage, micro-batch by micro-batch: the logits come back from the last
stage (``parallel/pipeline.py``).

On a GPU, pure-decode steps replay CUDA graphs instead (``decode_graphs``):
same inputs, copied into static buffers and padded to a captured size. On a
CPU the forward pass can run compiled (``compiled_forward``).

The runner commits nothing: the engine does, once the pass has succeeded.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from paged_core.protocols import ServingPoolProtocol
from paged_server.engine.compiled_forward import CompiledForward, padded_rows, row_buckets
from paged_server.engine.decode_graphs import DecodeGraphs
from paged_server.engine.sequence import Sequence


@dataclass(slots=True)
class PromptScores:
    """Logits of prompt rows of scheduled entry ``index``: row ``j`` predicts
    prompt token ``first + j``."""

    index: int
    first: int
    logits: Tensor


@dataclass(slots=True)
class StepLogits:
    """Logits ``[len(sampled), vocab]``; row ``j`` belongs to entry
    ``sampled[j]`` of the scheduled list."""

    logits: Tensor
    sampled: list[int]
    num_tokens: int  # rows that went through the model (no padding)
    prompt_scores: list[PromptScores] = field(default_factory=list)


class ModelRunner:
    """Runs the engine's forward passes over one cache pool."""

    def __init__(
        self,
        model: nn.Module,
        pool: ServingPoolProtocol,
        device: torch.device,
        decode_graphs: DecodeGraphs | None = None,
        before_forward: Callable[[list[int], Any, list[int]], None] | None = None,
        compiled: CompiledForward | None = None,
        pipeline: Any = None,
    ) -> None:
        self.model = model
        self.pool = pool
        self.device = device
        self.decode_graphs = decode_graphs
        self.compiled = compiled
        self._hidden_states = compiled.hidden_states if compiled else model.hidden_states
        self._compute_logits = compiled.compute_logits if compiled else model.compute_logits
        # Tensor/pipeline parallelism: sends (token ids, the step's view, the
        # sampled rows) to the other ranks, which then run their parts of the pass.
        self.before_forward = before_forward
        self.pipeline = pipeline  # parallel.pipeline.PipelineStep: rank 0's stage

    @torch.inference_mode()
    def execute(self, scheduled: list[tuple[Sequence, int]]) -> StepLogits:
        """Compute ``n`` more tokens of each ``(seq, n)`` in one forward pass,
        starting at ``seq.num_computed_tokens`` (room already reserved)."""
        batch = _decode_batch(scheduled) or _flat_batch(scheduled)
        ids, rows, sampled, scored = batch.ids, batch.rows, batch.sampled, batch.scored
        graphs = self.decode_graphs
        if graphs is not None and len(ids) == len(batch.seq_ids) <= graphs.max_size:
            hidden = graphs.run(batch.seq_ids, batch.starts, self._tensor(ids))
        else:
            view = self.pool.step_view(batch.seq_ids, batch.starts, batch.lens)
            if self.before_forward is not None:
                self.before_forward(ids, view, rows)
            if self.pipeline is not None:
                logits = self.pipeline.run(self._tensor(ids), view, rows)
                return self._step_logits(logits, sampled, scored, len(ids))
            hidden = self._hidden_states(self._tensor(ids), self._tensor(batch.positions), view)
        if not rows:  # chunks that end no prompt: no logits (and no 0-row graph to compile)
            return StepLogits(hidden.new_empty(0, 0), sampled, len(ids), [])
        if not batch.every_row:  # else the head reads hidden as it is: no copy
            hidden = hidden.index_select(0, self._tensor(rows))
        return self._step_logits(self._compute_logits(hidden), sampled, scored, len(ids))

    @staticmethod
    def _step_logits(
        logits: Tensor, sampled: list[int], scored: list[tuple[int, int, int, int]], num_tokens: int
    ) -> StepLogits:
        """Split the pass's logits: sampled rows first, then prompt rows scored."""
        scores, at = [], len(sampled)
        for i, first, _, count in scored:
            scores.append(PromptScores(i, first, logits[at : at + count]))
            at += count
        return StepLogits(logits[: len(sampled)], sampled, num_tokens, scores)

    def warm_up(self, prompt_len: int, head_rows: int = 1) -> float:
        """Compile what the server will use before the first request: every
        decode batch size (captured as graphs when there are graphs), one
        prefill of ``prompt_len`` tokens through a throwaway sequence, and,
        with a compiled forward pass, its one-token graph and every padded
        row count up to ``prompt_len`` (``row_buckets``: each builds oneDNN's
        matmuls for it), the LM head's up to ``head_rows`` (the sampled rows
        of a step: one per running sequence). Returns the seconds it took."""
        start = time.perf_counter()
        if self.decode_graphs is not None:
            with torch.inference_mode():
                self.decode_graphs.capture_all()
        sizes = [prompt_len]
        if self.compiled is not None:  # the largest first: it compiles the multi-row graph
            # prompt_len's pass runs the top bucket; every lower one is shorter than
            # prompt_len, so no pass runs a bucket twice or outgrows max_model_len
            top = padded_rows(prompt_len)
            sizes += [n for n in reversed(row_buckets(prompt_len)) if n != top]
        for num_tokens in sizes:
            self._throwaway_step(num_tokens, head_rows)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - start

    def _throwaway_step(self, num_tokens: int, head_rows: int) -> None:
        """A prefill of ``num_tokens`` through a sequence that is freed, never
        committed (nothing enters the prefix cache). The first view is built
        outside inference mode: page-table rows the pool grows here outlive
        the pass. The pass reads a second one built inside it, as ``execute``
        builds its views (compiled code guards on how its inputs were made)."""
        tokens = [0] * num_tokens
        seq_id, _ = self.pool.allocate_sequence(tokens)
        try:
            self.pool.step_view([seq_id], [0], [num_tokens])
            with torch.inference_mode():
                view = self.pool.step_view([seq_id], [0], [num_tokens])
                if self.before_forward is not None:
                    self.before_forward(tokens, view, [])
                if self.pipeline is not None:
                    self.pipeline.run(self._tensor(tokens), view, [])
                else:
                    positions = self._tensor(list(range(num_tokens)))
                    hidden = self._hidden_states(self._tensor(tokens), positions, view)
                    if self.compiled is not None:  # the head's graphs, at this row count
                        self._compute_logits(hidden[: min(num_tokens, head_rows)])
        finally:
            self.pool.free_seq(seq_id)

    def _tensor(self, data: list[int]) -> Tensor:
        # through numpy: ~4 us for a step's 256 ids against ~15 for torch.tensor(list)
        return torch.from_numpy(np.array(data, dtype=np.int64)).to(self.device)


@dataclass(slots=True)
class _Batch:
    """A step's flat layout: per sequence in batch order its pool seq_id,
    first position and token count; per token its id and position; the
    token ``rows`` whose logits are computed; the entries of the scheduled
    list that sample (``sampled``) and that score prompt rows (``scored``:
    (index, first token, row, count))."""

    seq_ids: list[int]
    starts: list[int]
    lens: list[int]
    ids: list[int]
    positions: list[int]
    rows: list[int]
    sampled: list[int]
    scored: list[tuple[int, int, int, int]]
    every_row: bool = False  # rows are all the token rows, in order


def _decode_batch(scheduled: list[tuple[Sequence, int]]) -> _Batch | None:
    """The common step, one token per sequence and no prompt to score, laid
    out in one pass: token ``i`` is entry ``i``, so it needs none of
    ``_flat_batch``'s per-token work. ``None`` for any other step."""
    seq_ids: list[int] = []
    starts: list[int] = []
    ids: list[int] = []
    sampled: list[int] = []
    for i, (seq, n) in enumerate(scheduled):
        if n != 1 or seq.request.params.prompt_logprobs is not None or seq.pool_seq_id is None:
            return None  # (no seq_id: _flat_batch names the sequence)
        start, token_ids = seq.num_computed_tokens, seq.token_ids
        seq_ids.append(seq.pool_seq_id)
        starts.append(start)
        ids.append(token_ids[start])
        if len(token_ids) == start + 1:
            sampled.append(i)
    return _Batch(
        seq_ids=seq_ids,
        starts=starts,
        lens=[1] * len(seq_ids),
        ids=ids,
        positions=starts,  # one token each, at its start
        rows=sampled,  # token row i is entry i
        sampled=sampled,
        scored=[],
        every_row=len(sampled) == len(seq_ids),
    )


def _flat_batch(scheduled: list[tuple[Sequence, int]]) -> _Batch:
    """Any step: sequences with one new token first, then prefill chunks."""
    order = [i for i, (_, n) in enumerate(scheduled) if n == 1]
    order += [i for i, (_, n) in enumerate(scheduled) if n != 1]
    b = _Batch([], [], [], [], [], [], [], [])
    for i in order:
        seq, n = scheduled[i]
        assert seq.pool_seq_id is not None, f"sequence {seq.seq_id} has no cache seq_id"
        start = seq.num_computed_tokens
        end = start + n
        b.seq_ids.append(seq.pool_seq_id)
        b.starts.append(start)
        b.lens.append(n)
        first, count = _prompt_rows_to_score(seq, start, end)
        if count:
            b.scored.append((i, first, len(b.ids) + first - 1 - start, count))
        b.ids += seq.token_ids[start:end]
        b.positions += range(start, end)
        if end == seq.num_tokens:
            b.rows.append(len(b.ids) - 1)
            b.sampled.append(i)
    for _, _, row, count in b.scored:
        b.rows += range(row, row + count)
    return b


def _prompt_rows_to_score(seq: Sequence, start: int, end: int) -> tuple[int, int]:
    """``(first, count)``: this step's rows ``start..end-1`` predict prompt
    tokens ``first..first+count-1`` that the request wants scored and that
    are not scored yet (a recompute after preemption scores nothing twice)."""
    request = seq.request
    if seq.index != 0 or not request.needs_prompt_logprobs:
        return 0, 0
    first = max(start + 1, len(request.prompt_logprobs))
    last = min(end, len(request.prompt_token_ids) - 1)  # the token row `end - 1` predicts
    return first, max(0, last - first + 1)
