"""Per-request edits of the logits before penalties and sampling:
``logit_bias`` (added to the listed tokens' logits), ``min_tokens``
(EOS and ``stop_token_ids`` masked until that many tokens are generated),
``bad_words`` (a word's last token masked when the output ends with the
tokens before it; indexed at submission, ``bad_words.py``) and
``allowed_token_ids`` (every other token masked), as vLLM applies them.
Rows that ask for neither are untouched, and a batch where none asks costs
nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from paged_server.engine.sample.sampling_row import SamplingRow


def apply_logits_processors(logits: Tensor, rows: Sequence[SamplingRow]) -> Tensor:
    """``logits`` (``[batch, vocab]``) with every row's bias and masks applied."""
    edits: list[tuple[int, int, float]] = []  # (row, token, bias); -inf masks
    always: list[tuple[int, Tensor]] = []  # (row, one-token bad words)
    logits = _allow_only(logits, rows)
    for i, row in enumerate(rows):
        params = row.params
        words = params.bad_words_index
        if words is not None:
            edits += [(i, t, float("-inf")) for t in words.banned_after(row.token_ids, row.num_prompt_tokens)]
            if words.always:
                always.append((i, words.always_ids(logits.device)))
        if params.logit_bias:
            edits += [(i, token, float(bias)) for token, bias in params.logit_bias.items()]
        generated = len(row.token_ids) - row.num_prompt_tokens
        if generated < params.min_tokens:
            stops = set(params.stop_token_ids)
            if not params.ignore_eos:
                stops |= set(row.eos_token_ids)
            edits += [(i, token, float("-inf")) for token in sorted(stops)]
    vocab = logits.shape[-1]
    edits = [e for e in edits if 0 <= e[1] < vocab]
    if not edits and not always:
        return logits
    device = logits.device
    row_idx = [torch.tensor([e[0] for e in edits], device=device, dtype=torch.long)]
    tok_idx = [torch.tensor([e[1] for e in edits], device=device, dtype=torch.long)]
    values = [torch.tensor([e[2] for e in edits], device=device, dtype=logits.dtype)]
    for i, tokens in always:
        tokens = tokens[tokens < vocab]
        row_idx.append(torch.full_like(tokens, i))
        tok_idx.append(tokens)
        values.append(torch.full(tokens.shape, float("-inf"), device=device, dtype=logits.dtype))
    index = (torch.cat(row_idx), torch.cat(tok_idx))
    return logits.index_put(index, torch.cat(values), accumulate=True)


def _allow_only(logits: Tensor, rows: Sequence[SamplingRow]) -> Tensor:
    """Rows with ``allowed_token_ids``: every other token masked."""
    limited = [(i, row.params.allowed_token_ids) for i, row in enumerate(rows)
               if row.params.allowed_token_ids]
    if not limited:
        return logits
    vocab = logits.shape[-1]
    keep = torch.ones(logits.shape, dtype=torch.bool, device=logits.device)
    for i, allowed in limited:
        keep[i] = False
        keep[i, [t for t in allowed if t < vocab]] = True
    return logits.masked_fill(~keep, float("-inf"))
