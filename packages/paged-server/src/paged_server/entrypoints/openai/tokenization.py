"""``/tokenize``, ``/detokenize`` and ``/version`` with vLLM's request and
response shapes, so clients written for vLLM (evaluation harnesses, token
counters) work unchanged. ``/tokenize`` takes a ``prompt`` or chat
``messages`` (rendered with the model's chat template, as the chat endpoint
does)."""

from __future__ import annotations

from importlib import metadata
from typing import Any

from pydantic import BaseModel, Field, model_validator

from paged_server.entrypoints.openai.errors import APIError
from paged_server.entrypoints.openai.protocol import ChatMessage, _Strict


class TokenizeRequest(_Strict):
    """POST /tokenize: text (``prompt``) or a conversation (``messages``)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = Field(True, description="Text only: add BOS etc. as the model does.")
    add_generation_prompt: bool = Field(True, description="Messages only.")
    return_token_strs: bool = Field(False, description="Also return each token as text.")

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("prompt: send exactly one of prompt (text) or messages (chat)")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Strict):
    """POST /detokenize."""

    model: str | None = None
    tokens: list[int] = Field(description="Token ids to turn back into text.")


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


def version() -> dict[str, str]:
    """The installed ``paged-server`` version."""
    try:
        return {"version": metadata.version("paged-server")}
    except metadata.PackageNotFoundError:  # running from a source tree
        return {"version": "0.0.0+unknown"}


class Tokenization:
    """The two tokenizer endpoints over the served model's tokenizer."""

    def __init__(self, tokenizer: Any, max_model_len: int, render_chat: Any) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.render_chat = render_chat  # async: messages, add_generation_prompt -> ids

    async def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        if body.messages is not None:
            ids = await self.render_chat(body.messages, body.add_generation_prompt)
        else:
            assert body.prompt is not None
            ids = list(self.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens))
        strs = None
        if body.return_token_strs:
            strs = [self.tokenizer.decode([t], skip_special_tokens=False) for t in ids]
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids,
                "token_strs": strs}

    def detokenize(self, body: DetokenizeRequest) -> dict[str, Any]:
        vocab = int(self.tokenizer.vocab_size)
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(
                400, f"tokens: token id {bad} is outside the vocabulary (0..{vocab - 1})",
                param="tokens",
            )
        return {"prompt": self.tokenizer.decode(body.tokens, skip_special_tokens=False)}
