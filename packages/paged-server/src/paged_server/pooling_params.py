"""What a pooling request asks for (vLLM's ``PoolingParams``): the task, and
how its vector is finished (``dimensions``, ``normalize``, ``activation``).

The engine reads it in place of ``SamplingParams``: a pooling request runs
its prompt only (no token is sampled) and finishes with one vector.
"""

from __future__ import annotations

from dataclasses import dataclass

# vLLM's pooling tasks this server runs: embed (a vector per prompt), classify
# (class probabilities), score (one relevance score; a classifier's or cosine),
# and the per-token ones: a vector (or class row) per prompt token.
TOKEN_TASKS = ("token_embed", "token_classify")
POOLING_TASKS = ("embed", "classify", "score", "encode", *TOKEN_TASKS)


@dataclass(frozen=True, slots=True)
class PoolingParams:
    """``dimensions``: keep the first N features (Matryoshka models only);
    ``normalize``: L2-normalize an embedding (None: the model's own choice);
    ``activation``: softmax/sigmoid on a classifier's output (None: on);
    ``truncate_prompt_tokens``: keep the prompt's last N tokens."""

    task: str = "embed"
    dimensions: int | None = None
    normalize: bool | None = None
    activation: bool | None = None
    truncate_prompt_tokens: int | None = None

    @property
    def per_token(self) -> bool:
        """Whether the answer is one row per prompt token (``token_embed``,
        ``token_classify``), not one per prompt."""
        return self.task in TOKEN_TASKS

    def validate(self, max_model_len: int) -> None:
        """Raise ``ValueError`` naming the first bad field."""
        if self.task not in POOLING_TASKS:
            raise ValueError(f"task: must be one of {', '.join(POOLING_TASKS)}, got {self.task!r}")
        if self.dimensions is not None and (
            isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int) or self.dimensions < 1
        ):
            raise ValueError(f"dimensions: must be an integer >= 1, got {self.dimensions!r}")
        n = self.truncate_prompt_tokens
        if n is not None and n != -1 and (  # vLLM: -1 keeps max_model_len tokens
            isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= max_model_len
        ):
            raise ValueError(
                f"truncate_prompt_tokens: must be -1 or an integer in 1..{max_model_len} "
                f"(max_model_len), got {n!r}"
            )
