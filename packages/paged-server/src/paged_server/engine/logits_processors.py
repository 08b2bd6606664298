"""Per-request edits of the logits before penalties and sampling:
``logit_bias`` (added to the listed tokens' logits) and ``min_tokens``
(EOS and ``stop_token_ids`` masked until that many tokens are generated),
as vLLM applies them. Rows that ask for neither are untouched, and a batch
where none asks costs nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from paged_server.engine.sampler import SamplingRow


def apply_logits_processors(logits: Tensor, rows: Sequence[SamplingRow]) -> Tensor:
    """``logits`` (``[batch, vocab]``) with every row's bias and masks applied."""
    edits: list[tuple[int, int, float]] = []  # (row, token, bias); -inf masks
    for i, row in enumerate(rows):
        params = row.params
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
    if not edits:
        return logits
    device = logits.device
    row_idx = torch.tensor([e[0] for e in edits], device=device)
    tok_idx = torch.tensor([e[1] for e in edits], device=device)
    values = torch.tensor([e[2] for e in edits], device=device, dtype=logits.dtype)
    return logits.index_put((row_idx, tok_idx), values, accumulate=True)
