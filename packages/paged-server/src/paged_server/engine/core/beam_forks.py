"""Beam search on the pool's forks: the engine side of ``BeamScorer``.

A beam-search request runs ``beam_width`` sequences, one per beam. Choice 0
computes the prompt alone; after that all beams advance in lock step: once
every beam's last token is computed, the scorer picks the next beams, and
their sequences take over the KV of their parents:

- a parent with no surviving child frees its seq_id (its own blocks go
  back; blocks shared with other beams stay);
- a parent's first child keeps the parent's seq_id (and its blocks);
- each further child forks the parent's seq_id (copy-on-write: the shared
  last block is copied only when the child writes into it).

A child that finds no seq_id to fork into (contiguous pool full) is
recomputed from its tokens, like a preempted sequence. The beams' sequences
are never sampled, but ``logit_bias`` and ``min_tokens`` edit their logits
as the sampler's would (``logits_processors``) before the log-softmax the
search scores: the beams search the biased distribution, and the
log-probabilities they report are that distribution's (transformers' beam
scores). At the end the ``n`` best hypotheses become choices ``0..n-1``
(text, token ids, log-probabilities with ``logprobs`` top alternatives)
and the rest are dropped.
"""

from __future__ import annotations

from collections.abc import Collection

import torch
from torch import Tensor

from paged_core.protocols import KVCacheManagerProtocol
from paged_server.engine.core.scheduler import Scheduler
from paged_server.engine.output.output_processor import release_text
from paged_server.engine.request.sequence import Request, Sequence, SequenceStatus
from paged_server.engine.sample.beam_scorer import BeamScorer, BeamStep
from paged_server.engine.sample.logits_processors import apply_logits_processors
from paged_server.engine.sample.sampling_row import SamplingRow
from paged_server.engine.sample.token_sets import joined_constraints


def new_beam_search(
    request: Request, eos_token_ids: Collection[int], max_model_len: int
) -> BeamScorer:
    """The scorer for ``request``: EOS (unless ``ignore_eos``) and
    ``stop_token_ids`` end a beam; ``max_model_len`` caps ``max_tokens``."""
    params = request.params
    stops = set(params.stop_token_ids)
    if not params.ignore_eos:
        stops |= set(eos_token_ids)
    room = max_model_len - len(request.prompt_token_ids)
    return BeamScorer(
        beam_width=params.beam_width,
        max_tokens=min(params.max_tokens, room),
        length_penalty=params.length_penalty,
        early_stopping=params.early_stopping,
        stop_token_ids=frozenset(stops),
        num_top_logprobs=params.logprobs or 0,
    )


def live_beams(request: Request) -> list[Sequence]:
    """The beams that hold tokens now: beam 0 alone until the first step."""
    return request.seqs if request.forked else request.seqs[:1]


def ready_rows(request: Request) -> list[Tensor] | None:
    """Every live beam's logits row once all of them are computed, else
    ``None`` (a beam being recomputed after preemption is not ready)."""
    rows = []
    for seq in live_beams(request):
        row = request.beam_rows.get(seq.index)
        if row is None or seq.pool_seq_id is None or seq.num_computed_tokens != seq.num_tokens:
            return None
        rows.append(row)
    return rows


def advance_beams(
    request: Request,
    rows: list[Tensor],
    pool: KVCacheManagerProtocol,
    scheduler: Scheduler,
    eos_token_ids: Collection[int],
) -> bool:
    """One beam step from the live beams' logits (``logit_bias`` and
    ``min_tokens`` applied first); ``True`` when the search is over (then
    ``finish_beams`` reports it)."""
    beam = request.beam
    assert beam is not None
    request.beam_rows = {}
    edit = [
        SamplingRow(request.params, None, seq.token_ids, seq.num_prompt_tokens, eos_token_ids)
        for seq in live_beams(request)
    ]
    logits = apply_logits_processors(torch.stack(rows).to(torch.float32), edit)
    # A beam whose constraints forbid every token has no continuation (its
    # row would be NaN): -inf, which the scorer never takes.
    logprobs = torch.log_softmax(logits, dim=-1).nan_to_num(nan=float("-inf"))
    if len(rows) == 1:  # before the first step every beam is the prompt
        logprobs = logprobs.expand(beam.beam_width, -1)
    result = beam.step(logprobs)
    if len(rows) == 1:  # so each beam continues beam 0, whichever row it came from
        result.parents = [0] * len(result.parents)
    if not result.done:
        _reassign(request, result, pool, scheduler)
    return result.done


def _reassign(
    request: Request, result: BeamStep, pool: KVCacheManagerProtocol, scheduler: Scheduler
) -> None:
    """Move each beam's sequence onto its parent's KV (see module doc)."""
    before = {}
    for seq in live_beams(request):
        assert seq.pool_seq_id is not None, f"beam {seq.index} holds no KV at a beam step"
        before[seq.index] = (seq.pool_seq_id, list(seq.token_ids), seq.num_computed_tokens)
    children: dict[int, list[int]] = {}
    for j, parent in enumerate(result.parents):
        children.setdefault(parent, []).append(j)
    for parent, (seq_id, _, _) in before.items():
        if parent not in children:  # dropped: its own blocks go back first
            pool.free_seq(seq_id)
    new_ids: dict[int, int | None] = {}
    for parent, js in children.items():
        seq_id = before[parent][0]
        new_ids[js[0]] = seq_id
        for j in js[1:]:
            try:
                new_ids[j] = pool.fork_seq(seq_id)
            except RuntimeError:  # no seq_id free (contiguous pool): recompute it
                new_ids[j] = None
    for j, seq in enumerate(request.seqs):
        _, token_ids, computed = before[result.parents[j]]
        seq.token_ids = token_ids + [result.token_ids[j]]
        seq.pool_seq_id = new_ids[j]
        if seq.status is not SequenceStatus.RUNNING:  # beams 1.. at the first step
            scheduler.add_running(seq)
        if seq.pool_seq_id is None:
            scheduler.running.remove(seq)
            seq.num_computed_tokens = 0
            scheduler.requeue_front(seq)
        else:
            seq.num_computed_tokens = computed
    request.forked = True


def finish_beams(request: Request) -> list[Sequence]:
    """Write the ``n`` best hypotheses into choices ``0..n-1`` and finish
    every beam; returns the sequences to report."""
    beam = request.beam
    assert beam is not None
    params = request.params
    best = beam.best(params.n)
    if len(best) < params.n:  # the constraints allow fewer outputs than asked for
        error = (
            f"use_beam_search: only {len(best)} output(s) can be generated under "
            f"{joined_constraints(params)}, fewer than n = {params.n}; "
            "lower n or allow more tokens"
        )
        for seq in request.seqs:
            seq.finish("error", error)
        return request.seqs[: params.n]
    for j, seq in enumerate(request.seqs):
        if j >= len(best):  # beams beyond n are dropped unreported
            seq.finish("length")
            continue
        hyp = best[j]
        stopped = hyp.token_ids[-1] in beam.stop_token_ids
        seq.token_ids = request.prompt_token_ids + hyp.token_ids
        seq.new_token_ids = list(hyp.token_ids)
        seq.logprobs, seq.new_logprobs = list(hyp.logprobs), list(hyp.logprobs)
        seq.new_top_logprobs = list(hyp.top_logprobs)
        seq.cumulative_logprob = hyp.cum_logprob
        texted = hyp.token_ids
        if stopped and not params.include_stop_str_in_output:
            texted = texted[:-1]  # a stop token adds no text
        seq.output_text = "".join(seq.text_stream.add(t) for t in texted) + seq.text_stream.flush()
        seq.finish("stop" if stopped else "length")
        release_text(seq)
    return request.seqs[: len(best)]
