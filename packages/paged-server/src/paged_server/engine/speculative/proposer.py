"""The seam between the engine and whatever drafts tokens.

The engine hands a proposer every sequence that may speculate this step
(its tokens so far, and how many drafts it has room for) and gets back one
draft per sequence, all at once so a proposer that runs a model (a draft
model, EAGLE or MTP heads) can batch them. Drafts are proposed with
certainty (one token per position, no distribution), which is what
``verify.py``'s rejection sampling assumes. Built: prompt lookup
(``ngram.py``) and a draft model (``draft_model.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from paged_server.engine.speculative.draft_model import DraftModelProposer, Engine
from paged_server.engine.speculative.ngram import NgramProposer
from paged_server.speculative_config import SpeculativeConfig


class Proposer(Protocol):
    """What drafts tokens for speculative decoding."""

    # Seconds the last ``propose_all`` spent on work that drafting every step
    # would not repeat (a draft model catching up on a history): the engine's
    # step timing (``StepCost``) leaves it out.
    backlog_seconds: float

    def propose_all(
        self, keys: Sequence[int], histories: Sequence[Sequence[int]], limits: Sequence[int]
    ) -> list[list[int]]:
        """One draft per sequence: at most ``limits[i]`` tokens to follow
        ``histories[i]``; ``keys[i]``: the sequence's id (a proposer may keep
        state per sequence between calls, as a draft model its KV)."""
        ...

    def retain(self, keys: Sequence[int]) -> None:
        """Drop what is kept for any sequence but ``keys`` (the running ones)."""
        ...

    def shutdown(self) -> None:
        """Free what the proposer holds (a draft model's engine)."""
        ...


def build_proposer(spec: SpeculativeConfig, target: Engine) -> Proposer:
    """The proposer ``spec.method`` names (``SpeculativeConfig.parse`` refused
    the rest), for ``target`` (its pool sized, its tokenizer loaded)."""
    if spec.method == "ngram":
        return NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)
    if spec.method == "draft_model":
        return DraftModelProposer(spec, target)
    raise ValueError(f"speculative_config: no proposer for method {spec.method!r}")
