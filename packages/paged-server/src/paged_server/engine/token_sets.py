"""A request's token sets at submission: ``bad_words`` indexed and
``allowed_token_ids`` within the vocabulary."""

from __future__ import annotations

import dataclasses
from typing import Any

from paged_server.engine.bad_words import index_bad_words
from paged_server.sampling_params import SamplingParams


def resolve_token_sets(params: SamplingParams, tokenizer: Any, vocab: int) -> SamplingParams:
    """``params`` with ``bad_words`` indexed (unless the API did it already,
    off the engine thread); ``ValueError`` for an allowed token id outside
    the vocabulary."""
    outside = [t for t in params.allowed_token_ids or [] if t >= vocab]
    if outside:
        raise ValueError(
            f"allowed_token_ids: token id {outside[0]} is outside the vocabulary (0..{vocab - 1})"
        )
    if not params.bad_words or params.bad_words_index is not None:
        return params
    return dataclasses.replace(params, bad_words_index=index_bad_words(tokenizer, params.bad_words))
