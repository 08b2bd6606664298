"""The API clients call: OpenAI's completions, chat, responses, embeddings
and models, Anthropic's messages, vLLM's ``/pooling``, ``/classify``,
``/score``, ``/rerank``, ``/tokenize``, ``/detokenize`` and ``/version``,
on one ``APIRouter``."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from paged_server.entrypoints.openai.errors import APIError
from paged_server.entrypoints.openai.messages_protocol import MessagesRequest
from paged_server.entrypoints.openai.messages_serving import AnthropicMessages
from paged_server.entrypoints.openai.pooling_protocol import (
    ClassificationRequest,
    EmbeddingRequest,
    PoolingRequest,
    RerankRequest,
    ScoreRequest,
)
from paged_server.entrypoints.openai.pooling_serving import OpenAIPooling
from paged_server.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    lone_surrogate_path,
)
from paged_server.entrypoints.openai.responses_protocol import ResponsesRequest
from paged_server.entrypoints.openai.responses_serving import OpenAIResponses
from paged_server.entrypoints.openai.serving import OpenAIServing
from paged_server.entrypoints.openai.tokenization import (
    DetokenizeRequest,
    DetokenizeResponse,
    Tokenization,
    TokenizeRequest,
    TokenizeResponse,
    VersionResponse,
    version,
)
from paged_server.lora_request import LoRARequest

ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": what}
    for status, what in {
        400: "Invalid request (the error names the field)",
        401: "Missing or wrong API key",
        404: "Unknown model",
        413: "Request body too large",
        503: "Queue full (see Retry-After) or server shutting down",
    }.items()
}
# One server-sent event (OpenAPI < 3.2: the schema describes each event).
_SSE = {
    "text/event-stream": {
        "schema": {
            "type": "object",
            "required": ["data"],
            "properties": {
                "data": {
                    "type": "string",
                    "description": "a JSON chunk (text_completion or chat.completion.chunk; "
                    "with include_usage a last chunk with empty choices and the usage), an "
                    '{"error": ...} object, or the final [DONE]',
                }
            },
        }
    }
}

# Named server-sent events (the Responses and Messages APIs).
_EVENTS = {
    "text/event-stream": {
        "schema": {
            "type": "object",
            "required": ["event", "data"],
            "properties": {
                "event": {"type": "string", "description": "the event's type"},
                "data": {"type": "string", "description": "the event as a JSON object"},
            },
        }
    }
}


def api_router(
    serving: OpenAIServing,
    tokenization: Tokenization,
    model_names: tuple[str, ...],
    max_model_len: int,
    responses: OpenAIResponses | None = None,
    pooling: OpenAIPooling | None = None,
) -> APIRouter:
    """The client-facing routes over ``serving``; ``model_names``: the
    served name first, then its aliases (``--served-model-name a b``)."""
    router = APIRouter()
    responses = responses if responses is not None else OpenAIResponses(serving)
    messages = AnthropicMessages(serving)
    pooling = pooling if pooling is not None else OpenAIPooling(serving.engine, serving.tokenizer, None, serving)
    created = int(time.time())

    @router.post(
        "/v1/completions",
        response_model=CompletionResponse,
        responses={200: {"content": _SSE}, **ERRORS},
        summary="Complete a prompt (stream: true for server-sent events)",
    )
    async def completions(body: CompletionRequest, request: Request) -> Response:
        _check_text(body)
        return await serving.completions(body, request)

    @router.post(
        "/v1/chat/completions",
        response_model=ChatCompletionResponse,
        responses={200: {"content": _SSE}, **ERRORS},
        summary="Chat with the model's chat template (stream: true for server-sent events)",
    )
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        _check_text(body)
        return await serving.chat(body, request)

    @router.post(
        "/v1/responses",
        responses={200: {"content": _EVENTS}, **ERRORS},
        summary="OpenAI's Responses API over the chat path (stream: true for named events)",
    )
    async def create_response(body: ResponsesRequest, request: Request) -> Response:
        _check_text(body)
        return await responses.create(body, request)

    @router.get("/v1/responses/{response_id}", responses=ERRORS)
    async def retrieve_response(response_id: str) -> dict[str, Any]:
        """A response created with ``store: true`` (held in memory, least recently used evicted)."""
        return responses.retrieve(response_id)

    @router.delete("/v1/responses/{response_id}", responses=ERRORS)
    async def delete_response(response_id: str) -> dict[str, Any]:
        """Forget a stored response."""
        return responses.delete(response_id)

    @router.post(
        "/v1/messages",
        responses={200: {"content": _EVENTS}, **ERRORS},
        summary="Anthropic's Messages API over the chat path (stream: true for named events)",
    )
    async def create_message(body: MessagesRequest, request: Request) -> Response:
        _check_text(body)
        return await messages.create(body, request)

    @router.post("/v1/embeddings", responses=ERRORS, summary="OpenAI's embeddings (--runner pooling)")
    async def embeddings(body: EmbeddingRequest, request: Request) -> dict[str, Any]:
        return await pooling.embeddings(body, request)

    @router.post("/pooling", responses=ERRORS, summary="vLLM's pooled outputs (--runner pooling)")
    async def pool(body: PoolingRequest, request: Request) -> dict[str, Any]:
        return await pooling.pooling(body, request)

    @router.post("/classify", responses=ERRORS, summary="Class probabilities (a classifier)")
    async def classify(body: ClassificationRequest, request: Request) -> dict[str, Any]:
        return await pooling.classify(body, request)

    for path in ("/score", "/v1/score"):
        router.add_api_route(path, _score(pooling), methods=["POST"], responses=ERRORS,
                             summary="Scores of text pairs (a cross-encoder, or an embedding model's cosine)")
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        router.add_api_route(path, _rerank(pooling), methods=["POST"], responses=ERRORS,
                             summary="Documents ranked by relevance to a query")

    @router.post("/tokenize", response_model=TokenizeResponse, responses=ERRORS)
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        """Token ids of a text or a conversation (vLLM's /tokenize)."""
        _check_text(body)
        serving.check_model(body.model)
        return await tokenization.tokenize(body)

    @router.post("/detokenize", response_model=DetokenizeResponse, responses=ERRORS)
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        """Text of token ids (vLLM's /detokenize)."""
        serving.check_model(body.model)
        return tokenization.detokenize(body)

    @router.get("/version", response_model=VersionResponse)
    async def get_version() -> dict[str, str]:
        return version()

    def model_card(name: str | None = None) -> dict[str, Any]:
        return {
            "id": name or model_names[0],
            "object": "model",
            "created": created,
            "owned_by": "paged",
            "root": model_names[0],
            "max_model_len": max_model_len,
        }

    def lora_card(lora: LoRARequest) -> dict[str, Any]:
        """A LoRA adapter as vLLM lists it: its path as ``root``, its base as ``parent``."""
        card = model_card(lora.lora_name)
        return {**card, "root": lora.lora_path, "parent": lora.base_model_name or model_names[0]}

    @router.get("/v1/models", response_model=ModelList, responses={401: ERRORS[401]})
    async def models() -> dict[str, Any]:
        """The served model under each of its names, then every LoRA adapter served now."""
        cards = [model_card(name) for name in model_names]
        return {"object": "list", "data": cards + [lora_card(r) for r in serving.loras().values()]}

    @router.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=ERRORS)
    async def model(model_id: str) -> dict[str, Any]:
        """One model or adapter (OpenAI's retrieve-model); 404 for any other id."""
        lora = serving.check_model(model_id)
        return model_card(model_id) if lora is None else lora_card(lora)

    return router


def _score(pooling: OpenAIPooling) -> Any:
    async def score(body: ScoreRequest, request: Request) -> dict[str, Any]:
        return await pooling.score(body, request)

    return score


def _rerank(pooling: OpenAIPooling) -> Any:
    async def rerank(body: RerankRequest, request: Request) -> dict[str, Any]:
        return await pooling.rerank(body, request)

    return rerank


def _check_text(body: Any) -> None:
    """A 400 naming the first field whose text cannot be encoded (a lone surrogate)."""
    path = lone_surrogate_path(body)
    if path is not None:
        raise APIError(
            400,
            f"{path}: contains a lone UTF-16 surrogate (such as \\ud800), which is not text; "
            "send valid Unicode",
            param=path,
            code="invalid_value",
        )
