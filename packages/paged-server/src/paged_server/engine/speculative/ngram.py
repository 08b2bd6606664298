"""Prompt lookup (vLLM's ``"method": "ngram"``): drafts copied from the request's own tokens.

When the last ``n`` tokens (``prompt_lookup_max`` down to ``prompt_lookup_min``)
appeared earlier in the prompt or output, the tokens that followed their
latest earlier appearance with a whole draft after it are the draft: code being edited, a document
being quoted, a conversation's earlier turns all repeat that way. No model
runs; the search is numpy over the sequence's tokens (one vectorised
comparison per n-gram length).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class NgramProposer:
    """Drafts of at most ``k`` tokens from n-grams of ``min_n``..``max_n`` tokens."""

    def __init__(self, k: int, min_n: int, max_n: int) -> None:
        self.k, self.min_n, self.max_n = k, min_n, max_n

    def propose_all(self, histories: Sequence[Sequence[int]], limits: Sequence[int]) -> list[list[int]]:
        """``propose`` for each sequence (the ``Proposer`` call)."""
        return [self.propose(h, limit) for h, limit in zip(histories, limits, strict=True)]

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
        for n in range(min(self.max_n, n_tokens - 1), self.min_n - 1, -1):
            suffix = tokens[n_tokens - n :]
            # windows starting at 0..n_tokens-n-1: every earlier place the suffix could sit
            windows = np.lib.stride_tricks.sliding_window_view(tokens[: n_tokens - 1], n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if len(hits):
                # The latest appearance (the nearest context) that is followed
                # by a whole draft; else the one followed by the most tokens.
                follow = n_tokens - (hits + n)
                whole = hits[follow >= limit]
                start = int(whole[-1] if len(whole) else hits[0]) + n
                return tokens[start : start + limit].tolist()  # type: ignore[no-any-return]
        return []
