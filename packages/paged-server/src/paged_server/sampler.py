"""Turn one row of logits per sequence into one token per sequence.

Vectorized across the batch: every filter takes per-row parameters as
tensors, so a batch mixing greedy, top-k and top-p requests costs one pass.
Randomness is per request: each row brings its own ``torch.Generator`` and
draws exactly one uniform number per token, so a seeded request gives the
same tokens whatever else shares its batch.

Order of processing (as in Hugging Face ``generate``): penalties ->
temperature -> top-k -> top-p -> min-p -> sample. Greedy rows
(temperature 0) take the argmax after penalties. A row whose logits hold
NaN or +inf gets an error instead of a token; the other rows are unharmed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from paged_server.sampling_params import SamplingParams


@dataclass(slots=True)
class SamplingRow:
    """What the sampler needs to know about one sequence."""

    params: SamplingParams
    generator: torch.Generator | None  # None: torch's global RNG (tests only)
    token_ids: Sequence[int]  # prompt + output so far (read only for penalties)
    num_prompt_tokens: int


@dataclass(slots=True)
class SamplerOutput:
    """One entry per row: the token (or -1), its logprob when asked, or an error."""

    token_ids: list[int]
    logprobs: list[float | None]
    errors: list[str | None]


def sample(logits: Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
    """Sample one token for each row of ``logits`` (``[batch, vocab]``).

    If the batched path raises (an unexpected parameter combination), each
    row is retried alone so only the offending request fails.
    """
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits must be [batch={len(rows)}, vocab], got {tuple(logits.shape)}")
    try:
        return _sample_batch(logits, rows)
    except Exception:  # isolate the failing row(s)
        out = SamplerOutput([], [], [])
        for i, row in enumerate(rows):
            try:
                one = _sample_batch(logits[i : i + 1], [row])
            except Exception as exc:
                one = SamplerOutput([-1], [None], [f"sampling failed: {exc}"])
            out.token_ids += one.token_ids
            out.logprobs += one.logprobs
            out.errors += one.errors
        return out


def _sample_batch(logits: Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
    logits = logits.float()
    batch, vocab = logits.shape
    device = logits.device
    errors: list[str | None] = [None] * batch

    bad = (
        torch.isnan(logits).any(-1)
        | torch.isposinf(logits).any(-1)
        | torch.isneginf(logits).all(-1)
    )
    if bool(bad.any()):
        for i in bad.nonzero().flatten().tolist():
            errors[i] = "model produced non-finite logits (NaN or inf) for this request"
        logits = torch.where(bad.unsqueeze(-1), torch.zeros_like(logits), logits)

    want_logprobs = [r.params.logprobs for r in rows]
    raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_logprobs) else None

    logits = apply_penalties(logits, rows)
    params = [r.params for r in rows]
    greedy = torch.tensor([p.greedy for p in params], device=device)
    temps = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params], device=device)
    logits = logits / temps.unsqueeze(-1)
    logits = apply_top_k(logits, torch.tensor([p.top_k for p in params], device=device))
    logits = apply_top_p(logits, torch.tensor([p.top_p for p in params], device=device))
    logits = apply_min_p(logits, torch.tensor([p.min_p for p in params], device=device))

    tokens = logits.argmax(dim=-1)
    if not bool(greedy.all()):
        probs = torch.softmax(logits, dim=-1)
        uniforms = torch.tensor(
            [0.0 if p.greedy else _uniform(r.generator) for p, r in zip(params, rows, strict=True)],
            device=device,
        )
        cdf = probs.cumsum(dim=-1)
        # right=True skips tokens with zero mass (equal cdf values).
        drawn = torch.searchsorted(cdf, (uniforms * cdf[:, -1]).unsqueeze(-1), right=True)
        drawn = drawn.squeeze(-1).clamp(max=vocab - 1)
        tokens = torch.where(greedy, tokens, drawn)

    token_list = tokens.tolist()
    logprob_list: list[float | None] = [None] * batch
    if raw_logprobs is not None:
        chosen = raw_logprobs.gather(1, tokens.unsqueeze(-1)).squeeze(-1).tolist()
        logprob_list = [
            lp if want else None for lp, want in zip(chosen, want_logprobs, strict=True)
        ]
    for i, err in enumerate(errors):
        if err is not None:
            token_list[i], logprob_list[i] = -1, None
    return SamplerOutput(token_list, logprob_list, errors)


def _uniform(generator: torch.Generator | None) -> float:
    """One draw in [0, 1) from the request's own generator."""
    return float(torch.rand((), generator=generator).item())


def apply_penalties(logits: Tensor, rows: Sequence[SamplingRow]) -> Tensor:
    """Repetition penalty over prompt + output tokens (divide positive logits,
    multiply negative ones); presence and frequency penalties over output
    token counts, subtracted (OpenAI semantics)."""
    rep_rows = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
    count_rows = [
        i
        for i, r in enumerate(rows)
        if r.params.presence_penalty != 0.0 or r.params.frequency_penalty != 0.0
    ]
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
        penalty = torch.tensor([r.params.repetition_penalty for r in rows], device=device)
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


def apply_top_k(logits: Tensor, top_k: Tensor) -> Tensor:
    """Keep each row's ``k`` largest logits (ties at the k-th value are kept); ``k=0`` is off."""
    if not bool((top_k > 0).any()):
        return logits
    vocab = logits.shape[-1]
    k = top_k.clamp(min=1, max=vocab).to(torch.long)
    sorted_desc = logits.sort(dim=-1, descending=True).values
    kth = sorted_desc.gather(1, (k - 1).unsqueeze(-1))
    drop = (logits < kth) & (top_k > 0).unsqueeze(-1)
    return logits.masked_fill(drop, float("-inf"))


def apply_top_p(logits: Tensor, top_p: Tensor) -> Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches ``top_p``."""
    if not bool((top_p < 1.0).any()):
        return logits
    probs = torch.softmax(logits, dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop_sorted = mass_before >= top_p.unsqueeze(-1)
    drop_sorted[:, 0] = False  # the most likely token always stays
    drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def apply_min_p(logits: Tensor, min_p: Tensor) -> Tensor:
    """Drop tokens less likely than ``min_p`` times the most likely token."""
    if not bool((min_p > 0).any()):
        return logits
    probs = torch.softmax(logits, dim=-1)
    threshold = min_p.unsqueeze(-1) * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < threshold, float("-inf"))
