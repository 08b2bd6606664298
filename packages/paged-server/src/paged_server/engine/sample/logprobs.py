"""Log-probabilities of chosen tokens and their top alternatives.

One function serves both uses: the sampler (the token it drew at each
sampled row) and prompt scoring (the prompt's next token at each prompt
row). Values are the model's own log-softmax, before bias, penalties and
temperature, as in vLLM; one ``topk`` over the vocabulary covers the whole
batch, sized for the row that asks for the most alternatives.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass(slots=True)
class TokenLogprobs:
    """One position: the token there, its log-probability and rank (1 = the
    most likely), and the ``N`` most likely tokens, most likely first."""

    token_id: int
    logprob: float
    rank: int = 1
    top: list[tuple[int, float]] = field(default_factory=list)

    def as_dict(self) -> dict[int, float]:
        """vLLM's shape: token id -> logprob, the token itself included."""
        return {**dict(self.top), self.token_id: self.logprob}


def token_logprobs(
    logits: Tensor, token_ids: Tensor, num_top: Sequence[int]
) -> list[TokenLogprobs]:
    """For each row of ``logits`` (``[rows, vocab]``): the log-probability of
    ``token_ids[row]`` and the ``num_top[row]`` most likely tokens."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return gather_logprobs(logprobs, token_ids, num_top)


def gather_logprobs(
    logprobs: Tensor, token_ids: Tensor, num_top: Sequence[int]
) -> list[TokenLogprobs]:
    """``token_logprobs`` over log-probabilities that are already normalized."""
    if logprobs.shape[0] == 0:
        return []
    chosen = logprobs.gather(1, token_ids.unsqueeze(-1))
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    k = min(max(num_top, default=0), logprobs.shape[-1])
    top_values: list[list[float]] = [[] for _ in num_top]
    top_ids: list[list[int]] = [[] for _ in num_top]
    if k > 0:
        values, ids = logprobs.topk(k, dim=-1)
        top_values, top_ids = values.tolist(), ids.tolist()
    return [
        TokenLogprobs(
            token_id=tid,
            logprob=lp,
            rank=rank,
            top=list(zip(top_ids[i][:n], top_values[i][:n], strict=True)),
        )
        for i, (tid, lp, rank, n) in enumerate(
            zip(
                token_ids.tolist(),
                chosen.squeeze(-1).tolist(),
                ranks.tolist(),
                num_top,
                strict=True,
            )
        )
    ]
