"""A request's token sets at submission: ``bad_words`` indexed,
``allowed_token_ids`` within the vocabulary, and at least one token left to
generate first.

Constraints that together forbid every token (``allowed_token_ids=[5]``
with a bad word that is token 5; only stop tokens allowed while
``min_tokens`` masks them; a structured output that cannot start with any
allowed token) are a 400 at submission, as vLLM refuses bad words that ban
every allowed token. What only a later step can show (a multi-token bad
word, a grammar's later state) ends the request with an error there
(``sampler.py``, ``beam_scorer.py``), never with a forbidden token.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from typing import Any

import torch
from torch import Tensor

from paged_server.engine.sample.bad_words import index_bad_words
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


def masked_stops(params: SamplingParams, eos_token_ids: Collection[int]) -> set[int]:
    """The tokens ``min_tokens`` masks until it is reached."""
    stops = set(params.stop_token_ids)
    if not params.ignore_eos:
        stops |= set(eos_token_ids)
    return stops


def check_first_token(
    params: SamplingParams, vocab: int, eos_token_ids: Collection[int], grammar: Tensor | None = None
) -> None:
    """``ValueError`` when the request's constraints leave no token to
    generate first; ``grammar``: the structured output's first mask (bool
    over the vocabulary)."""
    words = params.bad_words_index
    always = [t for t in (words.always if words is not None else ()) if t < vocab]
    stops = [t for t in masked_stops(params, eos_token_ids) if t < vocab] if params.min_tokens else []
    limited = params.allowed_token_ids is not None
    if not limited and grammar is None and len(always) + len(stops) < vocab:
        return  # nothing else narrows the vocabulary
    keep = torch.ones(vocab, dtype=torch.bool)
    if limited:
        keep[:] = False
        keep[params.allowed_token_ids] = True
    keep[always] = False
    keep[stops] = False
    if grammar is not None:
        keep &= grammar[:vocab]
    if bool(keep.any()):
        return
    field = "allowed_token_ids" if limited else "bad_words" if always else "min_tokens"
    raise ValueError(
        f"{field}: no token can be generated first: {_joined(constraint_names(params))} "
        "together forbid every token; allow more tokens or drop one of them"
    )


def constraint_names(params: SamplingParams) -> list[str]:
    """The request's fields that narrow which tokens may come next."""
    names = []
    if params.allowed_token_ids is not None:
        names.append("allowed_token_ids")
    if params.bad_words:
        names.append("bad_words")
    if params.min_tokens:
        names.append("min_tokens")
    if params.structured_outputs is not None:
        names.append("the structured output")
    return names


def nothing_allowed(params: SamplingParams) -> str:
    """The error of a request whose constraints forbid every token at a step."""
    return (
        f"no token can be generated: {_joined(constraint_names(params))} together forbid "
        "every token at this step; allow more tokens or drop one of them"
    )


def joined_constraints(params: SamplingParams) -> str:
    """``constraint_names`` as words: "a, b and c"."""
    return _joined(constraint_names(params))


def _joined(names: list[str]) -> str:
    return " and ".join(filter(None, [", ".join(names[:-1]), names[-1]])) if names else "the request"
