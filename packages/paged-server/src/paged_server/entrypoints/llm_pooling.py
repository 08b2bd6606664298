"""The offline ``LLM``'s pooling calls (``embed``, ``classify``, ``score``,
``encode``) on its engine: submit as the queue takes them, step until done."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from torch import Tensor

from paged_server.entrypoints.scoring import check_scoring, cosine, score_pairs
from paged_server.errors import QueueFullError
from paged_server.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from paged_server.pooling_params import PoolingParams


def pool(
    engine: Any, inputs: list[str | list[int]], params: PoolingParams, new_id: Callable[[], str]
) -> list[tuple[str, list[int], Tensor]]:
    """``(request id, prompt token ids, pooled tensor)`` per input, in order.
    Raises ``ValueError`` naming the first input the engine refused or failed
    (the others are aborted first)."""
    ids = [engine.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in inputs]
    order = [new_id() for _ in ids]
    pending = list(zip(order, ids, strict=True))
    done: dict[str, Tensor] = {}
    try:
        while pending or engine.has_unfinished():
            while pending:
                request_id, prompt = pending[0]
                try:
                    engine.add_request(request_id, prompt, params)
                except QueueFullError:
                    break
                except ValueError as exc:
                    raise ValueError(f"prompt {order.index(request_id)}: {exc}") from None
                pending.pop(0)
            for out in engine.step():
                if out.request_id in order and out.finished:
                    if out.pooled is None:
                        raise ValueError(f"prompt {order.index(out.request_id)}: {out.error}")
                    done[out.request_id] = out.pooled
    except BaseException:
        for request_id in order:
            engine.abort_request(request_id)
        while engine.has_unfinished():
            engine.step()
        raise
    return [(r, p, done[r]) for r, p in zip(order, ids, strict=True)]


def _pooled_as(
    task: str, engine: Any, inputs: list[str | list[int]], params: PoolingParams | None,
    new_id: Callable[[], str],
) -> list[tuple[str, list[int], Tensor]]:
    """``pool`` with ``params`` (defaults when None) set to ``task``."""
    return pool(engine, inputs, dataclasses.replace(params or PoolingParams(), task=task), new_id)


def embed(engine: Any, inputs: list[str | list[int]], params: PoolingParams | None,
          new_id: Callable[[], str]) -> list[EmbeddingRequestOutput]:  # fmt: skip
    """``LLM.embed``."""
    pooled = _pooled_as("embed", engine, inputs, params, new_id)
    return [EmbeddingRequestOutput(r, EmbeddingOutput(t.tolist()), ids) for r, ids, t in pooled]


def classify(engine: Any, inputs: list[str | list[int]], params: PoolingParams | None,
             new_id: Callable[[], str]) -> list[ClassificationRequestOutput]:  # fmt: skip
    """``LLM.classify``."""
    pooled = _pooled_as("classify", engine, inputs, params, new_id)
    return [ClassificationRequestOutput(r, ClassificationOutput(t.tolist()), ids) for r, ids, t in pooled]


def encode(engine: Any, inputs: list[str | list[int]], params: PoolingParams | None,
           new_id: Callable[[], str], task: str = "encode") -> list[PoolingRequestOutput]:  # fmt: skip
    """``LLM.encode``: the model's output for ``task`` as a tensor (a row per
    prompt token for ``token_embed`` / ``token_classify``)."""
    pooled = _pooled_as(task, engine, inputs, params, new_id)
    return [PoolingRequestOutput(r, PoolingOutput(t), ids) for r, ids, t in pooled]


def score(engine: Any, text_1: Any, text_2: Any, params: PoolingParams | None,
          new_id: Callable[[], str]) -> list[ScoringRequestOutput]:  # fmt: skip
    """``LLM.score``: a classifier's score of each pair read as one prompt,
    or an embedding model's cosine similarity of the two sides."""
    pairs = score_pairs(text_1, text_2)
    pooler = engine.pooler
    if pooler is None:
        raise ValueError("model: scoring needs a pooling model (--runner pooling)")
    check_scoring(pooler)
    if pooler.head == "classify":
        prompts: list[str | list[int]] = [engine.tokenizer.encode_pair(a, b) for a, b in pairs]
        return [
            ScoringRequestOutput(r, ScoringOutput(float(t[0])), ids)
            for r, ids, t in _pooled_as("score", engine, prompts, params, new_id)
        ]
    texts = list(dict.fromkeys(t for pair in pairs for t in pair))
    pooled = _pooled_as("score", engine, list(texts), params, new_id)
    vectors = {text: (ids, t) for text, (_, ids, t) in zip(texts, pooled, strict=True)}
    return [
        ScoringRequestOutput(new_id(), ScoringOutput(cosine(vectors[a][1], vectors[b][1])),
                             vectors[a][0] + vectors[b][0])
        for a, b in pairs
    ]  # fmt: skip
