"""The request bodies of the pooling API (pydantic): ``/v1/embeddings``
(OpenAI's), and vLLM's ``/pooling``, ``/classify``, ``/score`` and ``/rerank``."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_INPUTS = 2048  # OpenAI's limit on inputs per embeddings request

InputType = str | list[str] | list[int] | list[list[int]]


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    user: str | None = Field(None, description="Accepted and ignored (OpenAI's end-user id).")
    truncate_prompt_tokens: int | None = Field(
        None, ge=-1, description="Keep each input's last N tokens (-1: max_model_len)."
    )
    add_special_tokens: bool = Field(True, description="Add the tokenizer's special tokens.")


class EmbeddingRequest(_Body):
    """POST /v1/embeddings (OpenAI's body, vLLM's extensions)."""

    input: InputType = Field(
        description="Text, token ids, or a list of either (one embedding each)."
    )
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="float: lists of numbers; base64: little-endian float32 bytes."
    )
    dimensions: int | None = Field(
        None, description="Keep the first N features (models trained for Matryoshka only)."
    )
    normalize: bool | None = Field(None, description="L2-normalize (default: the model's own).")

    @field_validator("input")
    @classmethod
    def _check_input(cls, v: InputType) -> InputType:
        return check_inputs(v)


class PoolingRequest(EmbeddingRequest):
    """POST /pooling (vLLM's): the model's pooled output as it is."""

    dimensions: int | None = None
    task: str | None = Field(
        None, description="token_embed / token_classify: a row per prompt token (default: "
        "one pooled row, encode)."
    )


class ClassificationRequest(_Body):
    """POST /classify (vLLM's): class probabilities per input."""

    input: InputType

    @field_validator("input")
    @classmethod
    def _check_input(cls, v: InputType) -> InputType:
        return check_inputs(v)


class ScoreRequest(_Body):
    """POST /score (vLLM's): one ``text_1`` against each ``text_2``, or pairwise."""

    text_1: str | list[str]
    text_2: str | list[str]


class RerankRequest(_Body):
    """POST /rerank (Jina's and Cohere's shape, as vLLM serves it)."""

    query: str
    documents: list[str]
    top_n: int | None = Field(None, ge=0, description="Return the N best (0 or none: all).")
    return_documents: bool = True


def normalize_inputs(v: InputType) -> list[str | list[int]]:
    """Each input of a request, as text or token ids."""
    if isinstance(v, str):
        return [v]
    if v and all(isinstance(x, int) for x in v):
        return [list(v)]  # type: ignore[arg-type]
    return list(v)  # type: ignore[arg-type]


def check_inputs(v: InputType) -> InputType:
    """Refuse what OpenAI refuses: no input, an empty one, too many."""
    if isinstance(v, list) and not v:
        raise ValueError("must not be empty")
    inputs = normalize_inputs(v)
    if len(inputs) > MAX_INPUTS:
        raise ValueError(f"at most {MAX_INPUTS} inputs per request, got {len(inputs)}")
    for i, item in enumerate(inputs):
        if isinstance(item, list) and not item:  # text: the tokenizer's BOS may make it a prompt
            raise ValueError(f"input {i} is an empty list of token ids")
    return v
