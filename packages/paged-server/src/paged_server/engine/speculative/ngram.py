"""Prompt lookup (vLLM's ``"method": "ngram"``): drafts copied from the request's own tokens.

When the last ``n`` tokens (``prompt_lookup_max`` down to ``prompt_lookup_min``)
appeared earlier in the prompt or output, the tokens that followed their
latest earlier appearance with a whole draft after it are the draft: code being edited, a document
being quoted, a conversation's earlier turns all repeat that way. No model
runs; the search is numpy over the sequence's tokens: the places holding
the last token, narrowed one token further back at a time.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class NgramProposer:
    """Drafts of at most ``k`` tokens from n-grams of ``min_n``..``max_n`` tokens."""

    def __init__(self, k: int, min_n: int, max_n: int) -> None:
        self.k, self.min_n, self.max_n = k, min_n, max_n
        self.backlog_seconds = 0.0  # no model: nothing to catch up on

    def propose_all(
        self, keys: Sequence[int], histories: Sequence[Sequence[int]], limits: Sequence[int]
    ) -> list[list[int]]:
        """``propose`` for each sequence (the ``Proposer`` call)."""
        return [self.propose(h, limit) for h, limit in zip(histories, limits, strict=True)]

    def retain(self, keys: Sequence[int]) -> None:
        """Nothing to free: prompt lookup holds no state."""

    def shutdown(self) -> None:
        """Nothing to free: prompt lookup holds no state."""

    def propose(self, token_ids: Sequence[int], limit: int) -> list[int]:
        """The draft for a sequence of ``token_ids`` (at most ``limit`` tokens,
        and ``k``): the tokens after the latest earlier appearance of its
        longest suffix that appeared before; empty when none did."""
        limit = min(limit, self.k)
        n_tokens = len(token_ids)
        if limit < 1 or n_tokens <= self.min_n:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        last = n_tokens - 1
        # Earlier places the suffix could end, narrowed one token further back
        # at a time: after the loop, ``ends`` are those where the longest
        # suffix that appeared before (at most max_n tokens) ends.
        ends = np.flatnonzero(tokens[:last] == tokens[last])
        n = 1
        while len(ends) and n < self.max_n:
            reach = ends[ends >= n]  # room for one more token before
            longer = reach[tokens[reach - n] == tokens[last - n]]
            if not len(longer):
                break
            ends, n = longer, n + 1
        if not len(ends) or n < self.min_n:
            return []
        # The latest appearance (the nearest context) that is followed by a
        # whole draft; else the one followed by the most tokens.
        starts = ends + 1
        whole = starts[n_tokens - starts >= limit]
        start = int(whole[-1] if len(whole) else starts[0])
        return tokens[start : start + limit].tolist()  # type: ignore[no-any-return]
