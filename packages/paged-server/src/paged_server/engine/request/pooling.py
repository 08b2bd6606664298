"""A pooling request in the engine: the prompt rows it needs, pooled as
they are computed, and its answer when the prompt is done.

A pooling request runs through the same flat step as generation, prompt
only: its rows come back from the model's head (``models/pooler.py``: the
final-norm states, or a classifier's logits). Last-token pooling needs one
row, the one a generation request samples from; mean pooling keeps a
running sum over every chunk, CLS pooling the first row; a per-token task
(``token_embed``, ``token_classify``) keeps every row. ``upto`` counts the
positions pooled, so a recompute after preemption pools nothing twice.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from paged_server.models.pooler import PoolerConfig
from paged_server.pooling_params import PoolingParams
from paged_server.sampling_params import SamplingParams

# Tasks each head answers: an embedding model scores by cosine (the caller's part).
_TASKS = {"embed": ("embed", "score", "encode", "token_embed"),
          "classify": ("classify", "score", "encode", "token_classify")}


class PoolingState:
    """One pooling request's pool over its prompt (see module doc)."""

    __slots__ = ("pooler", "params", "upto", "total", "rows", "result")

    def __init__(self, pooler: PoolerConfig, params: PoolingParams) -> None:
        self.pooler = pooler
        self.params = params
        self.upto = 0  # prompt positions pooled so far
        self.total: Tensor | None = None  # MEAN: the sum of rows; CLS: row 0
        self.rows: list[Tensor] = []  # a per-token task's rows, in position order
        self.result: Tensor | None = None

    @property
    def skips_prefix_cache(self) -> bool:
        """A prefix hit leaves its tokens' rows uncomputed: mean/CLS pooling
        and per-token tasks need them."""
        return self.pooler.skips_prefix_cache or self.params.per_token

    def rows_wanted(self, start: int, end: int) -> tuple[int, int]:
        """``(first, count)``: positions of this step's chunk ``start..end-1``
        whose rows the pool still needs (none for last-token pooling)."""
        kind = self.pooler.pooling_type
        if kind == "MEAN" or self.params.per_token:
            first = max(start, self.upto)
            return first, max(0, end - first)
        if kind == "CLS" and start == 0 and self.upto == 0:
            return 0, 1
        return 0, 0

    def add(self, first: int, rows: Tensor) -> None:
        """Pool the rows of positions ``first..``; positions already pooled are skipped."""
        rows = rows[max(0, self.upto - first) :].float()
        if not rows.shape[0]:
            return
        if self.params.per_token:
            assert first <= self.upto, f"per-token pooling skipped positions {self.upto}..{first - 1}"
            self.rows.append(rows.clone())
        elif self.pooler.pooling_type == "CLS":
            self.total = rows[0].clone()
        else:
            part = rows.sum(dim=0)
            self.total = part if self.total is None else self.total + part
        self.upto = max(self.upto, first) + rows.shape[0]

    def finish(self, last_row: Tensor) -> Tensor:
        """The answer, from the prompt's last row: pooled, then (embeddings)
        cut to ``dimensions`` and normalized, or (classifiers) activated. A
        per-token task's answer has a row per prompt token, each finished so."""
        kind = self.pooler.pooling_type
        if self.params.per_token:
            assert self.rows, "per-token pooling saw no rows"
            pooled = torch.cat(self.rows)
        elif kind == "LAST":
            pooled = last_row.float()
        else:
            assert self.total is not None and self.upto, f"{kind} pooling saw no rows"
            pooled = self.total / self.upto if kind == "MEAN" else self.total
        params = self.params
        if self.pooler.head == "embed":
            if params.dimensions is not None:
                pooled = pooled[..., : params.dimensions]
            if self.pooler.normalize if params.normalize is None else params.normalize:
                pooled = F.normalize(pooled, dim=-1)
        elif self.pooler.activation if params.activation is None else params.activation:
            pooled = torch.sigmoid(pooled) if pooled.shape[-1] == 1 else torch.softmax(pooled, dim=-1)
        self.result = pooled.cpu()
        return self.result


def pooling_request(
    params: PoolingParams, pooler: PoolerConfig | None, max_model_len: int, model_name: str
) -> tuple[PoolingState, SamplingParams]:
    """A pooling request's state and the prompt-only sampling params the
    engine runs it with. Raises ``ValueError`` for what this model cannot do."""
    if pooler is None:
        raise ValueError(
            "task: this model runs generation; pooling requests (embeddings, scores) need "
            "--runner pooling"
        )
    params.validate(max_model_len)
    if params.task not in _TASKS[pooler.head]:
        raise ValueError(
            f"task: {params.task} is not supported by this model's {pooler.head} head "
            f"(it answers {', '.join(_TASKS[pooler.head])})"
        )
    check_dimensions(pooler, params.dimensions, model_name)
    truncate = params.truncate_prompt_tokens
    sampling = SamplingParams(
        max_tokens=1, detokenize=False,
        truncate_prompt_tokens=max_model_len if truncate == -1 else truncate,
    )  # fmt: skip
    return PoolingState(pooler, params), sampling


def pooling_tasks(pooler: PoolerConfig) -> tuple[str, ...]:
    """The tasks a pooling model's head answers."""
    return _TASKS[pooler.head]


def check_dimensions(pooler: PoolerConfig, dimensions: int | None, model_name: str) -> None:
    """vLLM's refusals of ``dimensions`` (its messages): a model that was not
    trained for Matryoshka truncation, or a size it does not list."""
    if dimensions is None:
        return
    if pooler.head != "embed" or pooler.matryoshka is None:
        raise ValueError(
            f'dimensions: Model "{model_name}" does not support matryoshka representation, '
            "changing output dimensions will lead to poor results."
        )
    if dimensions < 1:
        raise ValueError("dimensions: Dimensions must be greater than 0")
    if pooler.matryoshka and dimensions not in pooler.matryoshka:
        raise ValueError(
            f'dimensions: Model "{model_name}" only supports {list(pooler.matryoshka)} matryoshka '
            "dimensions, use other output dimensions will lead to poor results."
        )
