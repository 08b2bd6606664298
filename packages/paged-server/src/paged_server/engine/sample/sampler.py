"""Turn one row of logits per sequence into one token per sequence.

Vectorized across the batch: every filter takes per-row parameters as
tensors, so a batch mixing greedy, top-k and top-p requests costs one pass.
Randomness is per request: each row brings its own ``torch.Generator`` and
draws exactly one uniform number per token, so a seeded request gives the
same tokens whatever else shares its batch.

Order of processing: ``logit_bias`` and ``min_tokens``
(``logits_processors``), then (as in Hugging Face ``generate``) penalties ->
temperature -> top-k -> top-p -> min-p -> sample, the three filters on
logits sorted once per step (top-k keeps exactly k; ties go by sort order).
The draw itself always walks the cumulative distribution in vocabulary
order, whichever filters the batch uses: a row's token then depends only on
its own logits, parameters and generator, never on whether a neighbour's
filter made the batch sort. Greedy rows (``SamplingParams.greedy``:
temperature below 1e-5, 0 included) take the argmax after penalties; far
smaller temperatures would overflow ``logits / temperature`` to inf. A row
whose logits hold NaN or +inf, or whose constraints leave no token, gets an
error instead of a token; the other rows are unharmed. A token masked to
-inf before the sampler (a grammar, ``allowed_token_ids``) stays -inf
through penalties and temperature: the float parameters are clamped into
what float32 holds (``row_values``) before they become tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from paged_server.engine.sample.logits_processors import apply_logits_processors
from paged_server.engine.sample.logprobs import TokenLogprobs, gather_logprobs
from paged_server.engine.sample.sampling_row import (
    SamplingRow,
    has_count_penalty,
    has_repetition_penalty,
)
from paged_server.engine.sample.token_sets import nothing_allowed


@dataclass(slots=True)
class SamplerOutput:
    """One entry per row: the token (or -1), its logprobs when asked
    (``SamplingParams.logprobs`` alternatives), or an error."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    errors: list[str | None]


def sample(
    logits: Tensor, rows: Sequence[SamplingRow], top: tuple[Tensor, Tensor] | None = None
) -> SamplerOutput:
    """Sample one token for each row of ``logits`` (``[batch, vocab]``).

    If the batched path raises (an unexpected parameter combination), each
    row is retried alone so only the offending request fails. Each row's
    uniform is drawn once, before either attempt, so a retry leaves the
    neighbours' seeded draws as they would have been. ``top``: ``row_max(logits)``
    when the caller took it already (the launch thread, beside the pass).
    """
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits must be [batch={len(rows)}, vocab], got {tuple(logits.shape)}")
    uniforms = [0.0 if r.greedy else uniform(r.generator) for r in rows]
    try:
        return _sample_batch(logits, rows, uniforms, top)
    except Exception:  # isolate the failing row(s)
        out = SamplerOutput([], [], [])
        for i, row in enumerate(rows):
            try:
                one = _sample_batch(logits[i : i + 1], [row], uniforms[i : i + 1])
            except Exception as exc:
                one = SamplerOutput([-1], [None], [f"sampling failed: {type(exc).__name__}: {exc}"])
            out.token_ids += one.token_ids
            out.logprobs += one.logprobs
            out.errors += one.errors
        return out


def _sample_batch(
    logits: Tensor, rows: Sequence[SamplingRow], uniforms: Sequence[float],
    top: tuple[Tensor, Tensor] | None = None,
) -> SamplerOutput:  # fmt: skip
    logits = logits.float()
    batch = logits.shape[0]
    errors: list[str | None] = [None] * batch
    # The rows' needs, read before the first wait for the device (``bad.any()``
    # below): on a GPU this host work runs while the pass still does.
    want_logprobs = [r.params.logprobs is not None for r in rows]
    edits = any(r.edits_logits for r in rows)
    sampled = [i for i, r in enumerate(rows) if not r.greedy]
    # One pass finds each row's greedy token and checks it: the max is NaN
    # if the row holds a NaN, +inf if it holds +inf, -inf if every entry is.
    top_values, top_indices = top if top is not None else row_max(logits)
    bad = ~torch.isfinite(top_values)
    bad_rows = bad.nonzero().flatten().tolist() if bool(bad.any()) else []
    if bad_rows:
        for i in bad_rows:
            errors[i] = "model produced non-finite logits (NaN or inf) for this request"
        logits = torch.where(bad.unsqueeze(-1), torch.zeros_like(logits), logits)
        top_values, top_indices = row_max(logits)

    raw_logprobs = torch.log_softmax(logits, dim=-1) if True in want_logprobs else None

    processed = logits
    if edits:
        processed = apply_penalties(apply_logits_processors(logits, rows), rows)
    # Greedy rows keep this; without penalties or biases the max above is it.
    tokens, blocked = top_indices, []
    if processed is not logits:
        values, tokens = row_max(processed)
        # Constraints that forbid every token (allowed_token_ids against a
        # bad word's last token, say) end the row, never with a forbidden
        # token; so does a NaN or +inf the edits made (none should: a NaN's
        # index would be a token the grammar masked).
        none_left = ~torch.isfinite(values)
        if bool(none_left.any()):
            blocked = none_left.nonzero().flatten().tolist()
            for i in blocked:
                nothing = bool(values[i] == float("-inf"))
                errors[i] = errors[i] or (nothing_allowed(rows[i].params) if nothing else _NON_FINITE_EDIT)
            processed = torch.where(none_left.unsqueeze(-1), torch.zeros_like(processed), processed)
    logits = processed
    if sampled:
        sub_rows = [rows[i] for i in sampled]
        probs = _filtered_probs(logits[sampled], sub_rows)
        drawn_u = torch.tensor([uniforms[i] for i in sampled], device=logits.device)
        cdf = probs.cumsum(dim=-1)
        # A row left without a finite, positive total (NaN from overflowing
        # logits) has no distribution to draw from: an error, never a token.
        no_mass = ~(cdf[:, -1] > 0) | ~torch.isfinite(cdf[:, -1])
        if bool(no_mass.any()):
            for j in no_mass.nonzero().flatten().tolist():
                errors[sampled[j]] = errors[sampled[j]] or _NON_FINITE_EDIT
                blocked.append(sampled[j])
        # right=True skips tokens with zero mass (equal cdf values).
        drawn = torch.searchsorted(cdf, (drawn_u * cdf[:, -1]).unsqueeze(-1), right=True)
        vocab = probs.shape[-1]
        off_end = drawn >= vocab  # the draw rounded onto the total
        if bool(off_end.any()):  # take the last token with mass, not vocab - 1
            last_with_mass = vocab - 1 - (probs.flip(-1) > 0).int().argmax(dim=-1, keepdim=True)
            drawn = torch.where(off_end, last_with_mass, drawn)
        tokens[sampled] = drawn.squeeze(-1)

    token_list = tokens.tolist()
    logprob_list: list[TokenLogprobs | None] = [None] * batch
    if raw_logprobs is not None:
        asked = [i for i, want in enumerate(want_logprobs) if want]
        found = gather_logprobs(
            raw_logprobs[asked], tokens[asked], [rows[i].params.logprobs or 0 for i in asked]
        )
        for i, entry in zip(asked, found, strict=True):
            logprob_list[i] = entry
    for i in bad_rows + blocked:
        token_list[i], logprob_list[i] = -1, None
    return SamplerOutput(token_list, logprob_list, errors)


_MAX_BLOCK = 64  # row_max's block width on a CPU
_NON_FINITE_EDIT = (
    "sampling failed: this request's sampling parameters made its logits NaN or inf; "
    "try penalties and temperature nearer 1"
)
# vLLM accepts any positive double for repetition_penalty and temperature,
# and float32 makes 5e-324 a 0 and 1e300 an inf: logits / 0, -inf * 0 and
# -inf / inf are NaN, and a NaN's index is a token the grammar masked. A
# penalty of 2**-64 or 2**64 already decides every comparison a smaller or
# larger one would, and keeps |logits| up to 2**63 finite. (top_p, min_p
# and presence/frequency penalties that float32 makes 0 act as their limit.)
_PENALTY_RANGE = (2.0**-64, 2.0**64)
_FLOAT32_MAX = torch.finfo(torch.float32).max


def row_values(values: Sequence[float], low: float, high: float, device: torch.device) -> Tensor:
    """Per-row float parameters as a float32 tensor, each clamped into
    ``[low, high]`` while still a Python float (after the cast 5e-324 is
    already 0)."""
    return torch.tensor([min(max(v, low), high) for v in values], device=device)


def row_max(logits: Tensor) -> tuple[Tensor, Tensor]:
    """Each row's largest value and the index of its first occurrence (a NaN
    counts as largest), as ``logits.max(dim=-1)``. On a CPU it is taken in two
    passes over 64-wide blocks: torch's max-with-index runs several times
    slower there than a plain ``amax``."""
    rows, vocab = logits.shape
    if logits.device.type != "cpu" or vocab % _MAX_BLOCK or not logits.is_contiguous():
        top = logits.max(dim=-1)
        return top.values, top.indices
    blocks = logits.view(rows, vocab // _MAX_BLOCK, _MAX_BLOCK)
    values, block = blocks.amax(dim=-1).max(dim=-1)  # the first block holding the max
    inner = blocks[torch.arange(rows), block].max(dim=-1).indices
    return values, block * _MAX_BLOCK + inner


def sampling_distribution(logits: Tensor, rows: Sequence[SamplingRow]) -> Tensor:
    """The distribution each (non-greedy) row samples from, ``[batch, vocab]``
    in token order: penalties, temperature and filters applied."""
    processed = apply_logits_processors(logits.float(), rows)
    return _filtered_probs(apply_penalties(processed, rows), rows)


def _filtered_probs(logits: Tensor, rows: Sequence[SamplingRow]) -> Tensor:
    """Temperature, then top-k / top-p / min-p on logits sorted once;
    probabilities in token order (the order every row's draw uses)."""
    device = logits.device
    params = [r.params for r in rows]
    # A sampled row's temperature is at least GREEDY_TEMPERATURE; above
    # float32's largest, logits / inf would turn masked -inf into NaN.
    temps = row_values([p.temperature if not p.greedy else 1.0 for p in params], 0.0, _FLOAT32_MAX, device)
    logits = logits / temps.unsqueeze(-1)
    top_k = torch.tensor([p.top_k for p in params], device=device)
    top_p = torch.tensor([p.top_p for p in params], device=device)
    min_p = torch.tensor([p.min_p for p in params], device=device)
    if not any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0 for p in params):
        return torch.softmax(logits, dim=-1)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    sorted_probs = filter_sorted(sorted_logits, top_k, top_p, min_p)
    return torch.empty_like(sorted_probs).scatter_(1, order, sorted_probs)


def filter_sorted(sorted_logits: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor) -> Tensor:
    """Probabilities over logits sorted in descending order, keeping per row:
    the first ``top_k`` (0 = all); the smallest prefix whose mass reaches
    ``top_p``; tokens at least ``min_p`` times as likely as the first. The
    most likely token always stays."""
    vocab = sorted_logits.shape[-1]
    position = torch.arange(vocab, device=sorted_logits.device).unsqueeze(0)
    k = torch.where(top_k > 0, top_k, vocab).unsqueeze(-1)
    masked = sorted_logits.masked_fill(position >= k, float("-inf"))
    probs = torch.softmax(masked, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop = (mass_before >= top_p.unsqueeze(-1)) | (probs < min_p.unsqueeze(-1) * probs[:, :1])
    drop[:, 0] = False
    return torch.softmax(masked.masked_fill(drop, float("-inf")), dim=-1)


def uniform(generator: torch.Generator | None) -> float:
    """One draw in [0, 1) from the request's own generator."""
    return float(torch.rand((), generator=generator).item())


def apply_penalties(logits: Tensor, rows: Sequence[SamplingRow]) -> Tensor:
    """Repetition penalty over prompt + output tokens (divide positive logits,
    multiply negative ones); presence and frequency penalties over output
    token counts, subtracted (OpenAI semantics)."""
    rep_rows = [i for i, r in enumerate(rows) if has_repetition_penalty(r.params)]
    count_rows = [i for i, r in enumerate(rows) if has_count_penalty(r.params)]
    if not rep_rows and not count_rows:
        return logits
    logits = logits.clone()
    batch, vocab = logits.shape
    device = logits.device
    if rep_rows:
        seen = (
            _token_counts(
                [(i, list(rows[i].token_ids)) for i in rep_rows],
                batch,
                vocab,
                device,
            )
            > 0
        )
        penalty = row_values([r.params.repetition_penalty for r in rows], *_PENALTY_RANGE, device)
        penalty = penalty.unsqueeze(-1).expand_as(logits)
        penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, penalized, logits)
    if count_rows:
        counts = _token_counts(
            [(i, list(rows[i].token_ids[rows[i].num_prompt_tokens :])) for i in count_rows],
            batch,
            vocab,
            device,
        )
        presence = torch.tensor([r.params.presence_penalty for r in rows], device=device)
        frequency = torch.tensor([r.params.frequency_penalty for r in rows], device=device)
        logits = logits - frequency.unsqueeze(-1) * counts
        logits = logits - presence.unsqueeze(-1) * (counts > 0).float()
    return logits


def _token_counts(
    rows: list[tuple[int, list[int]]], batch: int, vocab: int, device: torch.device
) -> Tensor:
    """``[batch, vocab]`` float counts of each token id in each listed row."""
    counts = torch.zeros(batch, vocab, device=device)
    row_idx = [i for i, toks in rows for t in toks if 0 <= t < vocab]
    tok_idx = [t for _, toks in rows for t in toks if 0 <= t < vocab]
    if tok_idx:
        r = torch.tensor(row_idx, device=device)
        t = torch.tensor(tok_idx, device=device)
        counts.index_put_((r, t), torch.ones(len(tok_idx), device=device), accumulate=True)
    return counts
