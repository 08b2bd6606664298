"""What the sampler knows about one sequence: ``SamplingRow``, and which of
its passes a request's parameters turn on.

Its own module so the sampler and the logits processors both import it and
neither imports the other.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import torch

from paged_server.sampling_params import SamplingParams


@dataclass(slots=True)
class SamplingRow:
    """What the sampler needs to know about one sequence."""

    params: SamplingParams
    generator: torch.Generator | None  # None: torch's global RNG (tests only)
    token_ids: Sequence[int]  # prompt + output so far (read only for penalties)
    num_prompt_tokens: int
    eos_token_ids: Collection[int] = ()  # masked until min_tokens
    # From ``params``, read once per row and step: a batch where no row edits
    # its logits (processors or penalties) skips those passes, and a greedy
    # row draws no uniform.
    greedy: bool = field(init=False)
    edits_logits: bool = field(init=False)

    def __post_init__(self) -> None:
        self.greedy = self.params.greedy
        self.edits_logits = edits_logits(self.params) or penalizes(self.params)


def edits_logits(params: SamplingParams) -> bool:
    """Whether ``logits_processors.apply_logits_processors`` changes this request's row."""
    return bool(
        params.logit_bias or params.min_tokens or params.bad_words_index is not None
        or params.allowed_token_ids
    )  # fmt: skip


def penalizes(params: SamplingParams) -> bool:
    """Whether ``sampler.apply_penalties`` changes this request's row."""
    return has_repetition_penalty(params) or has_count_penalty(params)


def has_repetition_penalty(params: SamplingParams) -> bool:
    """Whether the request sets a repetition penalty (over prompt + output)."""
    return params.repetition_penalty != 1.0


def has_count_penalty(params: SamplingParams) -> bool:
    """Whether the request sets a presence or frequency penalty (over output counts)."""
    return params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
