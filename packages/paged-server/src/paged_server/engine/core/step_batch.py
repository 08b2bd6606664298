"""The engine core's half of a step: the scheduled sequences laid out as one flat batch, and its logits split back.

Every token the scheduler picked, of every sequence, goes into one
``[num_tokens]`` batch with no padding: sequences with one new token
(decodes) first, then prefill chunks, so the attention ops get each part as
a contiguous run of rows. The KV cache manager's ``step_layout`` says where
each token's K/V goes; the workers run the pass (``engine/worker/worker.py``). The
LM head runs only on the rows whose logits are needed: the last token of
each sequence whose tokens are all computed after this step, plus, for a
request that asked for ``prompt_logprobs``, the prompt rows whose next
prompt token is not scored yet, and for a mean- or CLS-pooling request
(``engine/request/pooling.py``) the prompt rows its pool still needs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from paged_server.engine.request.sequence import Sequence
from paged_server.engine.worker.worker import WorkerStep


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
    # Pooling requests' prompt rows (``PromptScores.first``: the position of row 0).
    pooled: list[PromptScores] = field(default_factory=list)
    # (entry, its logits [1 + drafts, vocab]) of each entry whose drafts were checked
    verified: list[tuple[int, Tensor]] = field(default_factory=list)
    # all of ``verified``'s rows, in its order (one tensor: checked in one pass)
    verified_rows: Tensor | None = None


def run_step(
    executor: Any, kv_manager: Any, scheduled: list[tuple[Sequence, int]],
    finish: Callable[[WorkerStep], WorkerStep] | None = None,
) -> StepLogits:  # fmt: skip
    """One step: ``scheduled`` laid out as one flat batch, its layout from
    ``kv_manager``, the pass on every rank (``executor.execute``, or one
    ``Worker``'s), the logits split back. Commits nothing. ``finish``: adds
    what else the step carries (the engine's LoRA adapters)."""
    batch = lay_out(scheduled)
    layout = kv_manager.step_layout(batch.seq_ids, batch.starts, batch.lens)
    step = WorkerStep(batch.ids, layout, batch.rows, batch.every_row)
    logits = executor.execute(step if finish is None else finish(step))
    assert logits is not None  # the driver's
    return split_logits(logits, batch.sampled, batch.scored, len(batch.ids), batch.pooled, batch.verified)


def split_logits(
    logits: Tensor, sampled: list[int], scored: list[tuple[int, int, int, int]], num_tokens: int,
    pooled: list[tuple[int, int, int, int]] | None = None,
    verified: list[tuple[int, int, int]] | None = None,
) -> StepLogits:  # fmt: skip
    """Split the pass's logits: sampled rows first, then prompt rows scored,
    then prompt rows pooled, then the rows of each entry whose drafts are checked."""
    parts: list[list[PromptScores]] = [[], []]
    at = len(sampled)
    for part, entries in zip(parts, (scored, pooled or []), strict=True):
        for i, first, _, count in entries:
            part.append(PromptScores(i, first, logits[at : at + count]))
            at += count
    checks, first = [], at
    for i, _, count in verified or []:
        checks.append((i, logits[at : at + count]))
        at += count
    rows = logits[first:at] if checks else None
    return StepLogits(logits[: len(sampled)], sampled, num_tokens, parts[0], parts[1], checks, rows)


@dataclass(slots=True)
class StepBatch:
    """A step's flat layout: per sequence in batch order its pool seq_id,
    first position and token count; per token its id; the
    token ``rows`` whose logits are computed; the entries of the scheduled
    list that sample (``sampled``) and that score prompt rows (``scored``:
    (index, first token, row, count)). A sequence starts where the steps
    before left it (``Sequence.scheduled_upto``: a step in flight included)."""

    seq_ids: list[int]
    starts: list[int]
    lens: list[int]
    ids: list[int]
    rows: list[int]
    sampled: list[int]
    scored: list[tuple[int, int, int, int]]
    every_row: bool = False
    # pooling requests' rows: (index, first position, row, count), after the scored ones
    pooled: list[tuple[int, int, int, int]] = field(default_factory=list)  # rows are all the token rows, in order
    # (token row, sequence) whose id is the token the step in flight samples
    # for that sequence (--async-scheduling): set before this step launches.
    fills: list[tuple[int, Sequence]] = field(default_factory=list)
    # Speculative decoding: (index, first row, count) of each entry whose
    # drafts this step checks: its last token and drafts, every row's logits.
    verified: list[tuple[int, int, int]] = field(default_factory=list)


def lay_out(scheduled: list[tuple[Sequence, int]]) -> StepBatch:
    """The step's flat layout (the common pure-decode step in one pass)."""
    return _decode_batch(scheduled) or _flat_batch(scheduled)


def _decode_batch(scheduled: list[tuple[Sequence, int]]) -> StepBatch | None:
    """The common step, one token per sequence and no prompt to score, laid
    out in one pass: token ``i`` is entry ``i``, so it needs none of
    ``_flat_batch``'s per-token work. ``None`` for any other step."""
    seq_ids: list[int] = []
    starts: list[int] = []
    ids: list[int] = []
    sampled: list[int] = []
    fills: list[tuple[int, Sequence]] = []
    for i, (seq, n) in enumerate(scheduled):
        request = seq.request
        if (
            n != 1 or request.params.prompt_logprobs is not None or request.pooling is not None
            or seq.pool_seq_id is None or seq.draft
        ):  # fmt: skip
            return None  # (no seq_id: _flat_batch names the sequence)
        # seq.scheduled_upto and seq.planned_tokens, inline (the host's critical path)
        start, token_ids = seq.num_computed_tokens + seq.num_inflight_tokens, seq.token_ids
        seq_ids.append(seq.pool_seq_id)
        starts.append(start)
        if start < len(token_ids):
            ids.append(token_ids[start])
        else:  # being sampled by the step in flight: filled in before launch
            fills.append((i, seq))
            ids.append(0)
        if len(token_ids) + seq.num_pending_samples == start + 1:
            sampled.append(i)
    return StepBatch(
        seq_ids=seq_ids,
        starts=starts,
        lens=[1] * len(seq_ids),
        ids=ids,
        rows=sampled,  # token row i is entry i
        sampled=sampled,
        scored=[],
        every_row=len(sampled) == len(seq_ids),
        fills=fills,
    )


def _flat_batch(scheduled: list[tuple[Sequence, int]]) -> StepBatch:
    """Any step: sequences with one new token first, then prefill chunks."""
    order = [i for i, (_, n) in enumerate(scheduled) if n == 1]
    order += [i for i, (_, n) in enumerate(scheduled) if n != 1]
    b = StepBatch([], [], [], [], [], [], [])
    for i in order:
        seq, n = scheduled[i]
        assert seq.pool_seq_id is not None, f"sequence {seq.seq_id} has no cache seq_id"
        start = seq.scheduled_upto
        end = start + n
        b.seq_ids.append(seq.pool_seq_id)
        b.starts.append(start)
        b.lens.append(n)
        first, count = _prompt_rows_to_score(seq, start, end)
        if count:
            b.scored.append((i, first, len(b.ids) + first - 1 - start, count))
        pooling = seq.request.pooling
        if pooling is not None and (wanted := pooling.rows_wanted(start, end))[1]:
            b.pooled.append((i, wanted[0], len(b.ids) + wanted[0] - start, wanted[1]))
        first_row = len(b.ids)
        b.ids += seq.token_ids[start:end]
        if seq.draft:  # its last token, then the drafts this step checks
            checked = end - seq.num_tokens
            b.ids += seq.draft[:checked]
            b.verified.append((i, first_row + n - checked - 1, checked + 1))
            continue
        if end > seq.num_tokens:  # its last token is being sampled (a step in flight)
            b.fills.append((len(b.ids), seq))
            b.ids.append(0)
        if end == seq.planned_tokens:
            b.rows.append(len(b.ids) - 1)
            b.sampled.append(i)
    for _, _, row, count in b.scored + b.pooled:
        b.rows += range(row, row + count)
    for _, row, count in b.verified:
        b.rows += range(row, row + count)
    # (a verify step of one sequence: its last token and drafts, every row's logits)
    b.every_row = len(b.rows) == len(b.ids) and b.rows == list(range(len(b.ids)))
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
