"""Checking a draft against the model: the tokens the model itself would have produced.

The verify pass computes logits at every drafted position at once: row
``i`` predicts the token after draft ``i - 1`` (row 0 the one after the
sequence's last token). Greedy rows accept drafts while each is the row's
argmax (after the request's biases, penalties and masks, as the sampler
takes it), then take the next argmax: exactly the non-speculative tokens.
Sampled rows use rejection sampling (Leviathan et al., 2023; vLLM's
``RejectionSampler``): draft ``i`` (proposed with certainty, as prompt
lookup proposes) is kept with probability ``p_i(draft)``, else the token
is drawn from ``p_i`` with the draft removed, and after every kept draft
one more is drawn from the next row, so every token follows the model's
own distribution ``p`` (temperature, top-k/p, min-p, penalties, bias).
Each row's history includes the drafts before it (penalties, bad words and
``min_tokens`` see what the model would have seen). Draws come from the
request's own generator, one uniform per decision: a seeded request gives
the same text whatever its neighbours, though not the text it gives
without speculation (the draws differ).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from paged_server.engine.sample.logits_processors import apply_logits_processors
from paged_server.engine.sample.logprobs import TokenLogprobs, gather_logprobs
from paged_server.engine.sample.sampler import (
    SamplingRow,
    apply_penalties,
    row_max,
    sampling_distribution,
    uniform,
)


@dataclass(slots=True)
class Verified:
    """The tokens to append (the kept drafts, then one more), their
    logprobs when asked, how many drafts were kept, or an error."""

    tokens: list[int]
    logprobs: list[TokenLogprobs | None]
    num_accepted: int
    error: str | None = None


@dataclass(slots=True)
class StepChecks:
    """What every checked row of a step needs, taken in one pass over all of
    them (a tensor op per sequence costs more than the op itself at 32
    streams): each row's argmax of the raw logits, and whether it is broken
    (NaN or +inf)."""

    argmax: list[int]
    broken: list[bool]

    @classmethod
    def of(cls, rows: Tensor) -> StepChecks:
        values, argmax = row_max(rows)  # a row's max is NaN if it holds one, +inf if it holds that
        return cls(argmax.tolist(), (~(values < float("inf"))).tolist())


def verify(
    logits: Tensor, drafts: list[int], row: SamplingRow, checks: StepChecks | None = None, first: int = 0
) -> Verified:
    """``logits``: ``[len(drafts) + 1, vocab]`` (float32) of one sequence;
    ``row``: its sampling row (history up to the token before the drafts).
    ``checks``: the step's ``StepChecks``, where this sequence's rows start
    at ``first`` (else they are taken here)."""
    count = len(drafts) + 1
    if logits.shape[0] != count:
        raise ValueError(f"{len(drafts)} drafts need {count} rows of logits, got {logits.shape[0]}")
    if checks is None:
        checks = StepChecks.of(logits)
        first = 0
    if any(checks.broken[first : first + count]):
        return Verified([], [], 0, "model produced non-finite logits (NaN or inf) for this request")
    if row.greedy:
        if row.edits_logits:
            rows = _drafted_rows(row, drafts)
            best = row_max(apply_penalties(apply_logits_processors(logits, rows), rows))[1].tolist()
        else:
            best = checks.argmax[first : first + count]
        kept = 0
        while kept < len(drafts) and best[kept] == drafts[kept]:
            kept += 1
        tokens = drafts[:kept] + [best[kept]]
    else:
        probs = sampling_distribution(logits, _drafted_rows(row, drafts))
        if not bool(torch.isfinite(probs).all()):
            return Verified([], [], 0, "sampling failed: this request's sampling parameters made its logits NaN or inf")
        tokens, kept = _reject(probs, drafts, row.generator)
    logprobs: list[TokenLogprobs | None] = [None] * len(tokens)
    if row.params.logprobs is not None:
        raw = torch.log_softmax(logits[: len(tokens)], dim=-1)
        chosen = torch.tensor(tokens, device=logits.device)
        logprobs = list(gather_logprobs(raw, chosen, [row.params.logprobs] * len(tokens)))
    return Verified(tokens, logprobs, kept)


def _reject(probs: Tensor, drafts: list[int], generator: torch.Generator | None) -> tuple[list[int], int]:
    """Rejection sampling of certain drafts against ``probs`` (``[k + 1, vocab]``)."""
    tokens: list[int] = []
    keep = probs[torch.arange(len(drafts)), torch.tensor(drafts, dtype=torch.long)].tolist() if drafts else []
    for i, draft in enumerate(drafts):
        if uniform(generator) < keep[i]:
            tokens.append(draft)
            continue
        residual = probs[i].clone()
        residual[draft] = 0.0  # p - q, q all on the draft: the rest of p, renormalised
        tokens.append(draw(residual, uniform(generator)))
        return tokens, i
    tokens.append(draw(probs[len(drafts)], uniform(generator)))
    return tokens, len(drafts)


def draw(probs: Tensor, u: float) -> int:
    """The token a uniform ``u`` picks from ``probs`` (unnormalised, token
    order), as the sampler draws: the first token whose cumulative mass
    passes ``u`` times the total, never one without mass."""
    cdf = probs.cumsum(dim=-1)
    pick = int(torch.searchsorted(cdf, (u * cdf[-1]).reshape(1), right=True).item())
    if pick >= probs.shape[-1]:  # the draw rounded onto the total: the last token with mass
        pick = int(torch.nonzero(probs > 0).max().item())
    return pick


def _drafted_rows(row: SamplingRow, drafts: list[int]) -> list[SamplingRow]:
    """The sampling row of each drafted position (built only where a row's
    history changes its logits or its draw: a plain greedy row needs none)."""
    return [_with_history(row, drafts[:i]) for i in range(len(drafts) + 1)]


def _with_history(row: SamplingRow, drafts: list[int]) -> SamplingRow:
    """``row`` as seen at a drafted position: its history plus the drafts before it."""
    if not drafts:
        return row
    return SamplingRow(
        row.params, row.generator, [*row.token_ids, *drafts], row.num_prompt_tokens, row.eos_token_ids
    )
