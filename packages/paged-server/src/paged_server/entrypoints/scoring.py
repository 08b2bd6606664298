"""Scores of text pairs (vLLM's ``LLM.score``, ``/score``, ``/rerank``): a
classifier reads each pair as one prompt (a cross-encoder), an embedding
model embeds both sides and answers their cosine similarity."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from paged_server.models.pooler import PoolerConfig


def score_pairs(text_1: str | Sequence[str], text_2: str | Sequence[str]) -> list[tuple[str, str]]:
    """vLLM's pairing: one ``text_1`` against each ``text_2``, or both lists
    of one length, pairwise. Raises ``ValueError`` otherwise."""
    firsts = [text_1] if isinstance(text_1, str) else list(text_1)
    seconds = [text_2] if isinstance(text_2, str) else list(text_2)
    if not firsts or not seconds:
        raise ValueError("text_1: and text_2 must each hold at least one text")
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    if len(firsts) != len(seconds):
        raise ValueError(
            f"text_1: {len(firsts)} texts against {len(seconds)} in text_2; pass one text_1, "
            "or as many as text_2"
        )
    return list(zip(firsts, seconds, strict=True))


def check_scoring(pooler: PoolerConfig) -> None:
    """A classifier scores with one label only (vLLM's rule)."""
    if pooler.head == "classify" and pooler.num_labels != 1:
        raise ValueError(
            f"model: scoring needs a classifier with one label (num_labels == 1), this one has "
            f"{pooler.num_labels}; use /classify"
        )


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """The cosine similarity of two embeddings."""
    return float(F.cosine_similarity(a.float(), b.float(), dim=-1))
