"""The FastAPI app: routes, guards, and the engine thread's lifetime.

``create_app(engine, settings, thread)`` takes an engine that is already
built (the model loaded), so a bad model path fails before the server binds
a port, and the `EngineThread` that built it, which then steps it.
The engine thread starts with the app and stops on shutdown, aborting what
is still in flight and closing its streams.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from paged_server.entrypoints.openai.async_engine import AsyncEngine, EngineLike, EngineThread
from paged_server.entrypoints.openai.errors import APIError, install_error_handlers
from paged_server.entrypoints.openai.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from paged_server.entrypoints.openai.metrics import ServerMetrics
from paged_server.entrypoints.openai.middleware import (
    DEFAULT_MAX_BODY_BYTES,
    OPEN_PATHS,
    APIKeyMiddleware,
    BodySizeLimitMiddleware,
)
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
from paged_server.entrypoints.openai.serving import OpenAIServing
from paged_server.entrypoints.openai.stats_logger import StatsLogger
from paged_server.entrypoints.openai.tokenization import (
    DetokenizeRequest,
    DetokenizeResponse,
    Tokenization,
    TokenizeRequest,
    TokenizeResponse,
    VersionResponse,
    version,
)
from paged_server.sampling_params import MAX_LOGPROBS

logger = logging.getLogger("paged_server.entrypoints.openai")

HEALTH_TIMEOUT_S = 10.0
_ERRORS: dict[int | str, dict[str, Any]] = {
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


@dataclass(slots=True)
class ServerSettings:
    """HTTP-side settings (the engine's are in ``EngineConfig``)."""

    model_name: str
    model_aliases: tuple[str, ...] = ()  # more names clients may send (--served-model-name a b)
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    shutdown_timeout_s: float = 30.0
    audit_interval_s: float = 60.0  # KV audit while idle (0 = never)
    announce: bool = False  # print start/stop lines (the CLI server does; test servers don't)
    tool_call_parser: str | None = None  # None: detected from the chat template
    enable_auto_tool_choice: bool = True  # False: tool_choice "auto" is a 400 (vLLM's default)
    reasoning_parser: str | None = None  # reasoning.REASONING_PARSERS
    chat_template: str | None = None  # replaces the tokenizer's
    response_role: str = "assistant"
    log_requests: bool = False  # one log line per request
    log_stats: bool = False  # the periodic stats line (the CLI turns it on)
    metrics_need_api_key: bool = False  # /metrics is open by default, as vLLM's
    allowed_origins: list[str] | None = None  # CORS; None: no CORS headers
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False
    root_path: str = ""  # behind a proxy that strips a prefix
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None


def create_app(
    engine: EngineLike, settings: ServerSettings, thread: EngineThread | None = None
) -> FastAPI:
    """The OpenAI-compatible app around ``engine`` (an ``LLMEngine``), stepped
    on ``thread``: the one that built it (``server.build_engine``), else a new one."""
    config: Any = getattr(engine, "config", None)
    max_model_len = int(config.max_model_len)
    metrics = ServerMetrics(settings.model_name, max_model_len)
    _cache_config_info(metrics, engine)
    async_engine = AsyncEngine(
        engine, metrics, audit_interval_s=settings.audit_interval_s, thread=thread,
        stats_logger=StatsLogger() if settings.log_stats else None,
    )
    tokenizer: Any = getattr(engine, "tokenizer", None)
    serving = OpenAIServing(
        async_engine,
        tokenizer,
        model_name=settings.model_name,
        max_model_len=max_model_len,
        tool_call_parser=settings.tool_call_parser,
        settings=settings,
        max_logprobs=int(getattr(config, "max_logprobs", MAX_LOGPROBS)),
        default_sampling=getattr(engine, "default_sampling", None),
    )
    tokenization = Tokenization(tokenizer, max_model_len, serving.render_messages)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.loop = asyncio.get_running_loop()  # for checks of leftover tasks
        async_engine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(async_engine.stop, settings.shutdown_timeout_s)
            shutdown = getattr(engine, "shutdown", None)
            if callable(shutdown):  # tensor-parallel workers exit with the server
                await asyncio.to_thread(shutdown)
            if settings.announce:
                print(
                    f"paged-server: engine stopped; {async_engine.aborted_at_shutdown} in-flight "
                    "request(s) aborted at shutdown",
                    file=sys.stderr,
                    flush=True,
                )

    app = FastAPI(
        title="paged-server",
        summary="OpenAI-compatible completions on a PagedAttention engine",
        version="0.1.0",
        lifespan=lifespan,
    )
    app.state.async_engine = async_engine
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.settings = settings
    install_error_handlers(app)

    @app.post(
        "/v1/completions",
        response_model=CompletionResponse,
        responses={200: {"content": _SSE}, **_ERRORS},
        summary="Complete a prompt (stream: true for server-sent events)",
    )
    async def completions(body: CompletionRequest, request: Request) -> Response:
        _check_text(body)
        return await serving.completions(body, request)

    @app.post(
        "/v1/chat/completions",
        response_model=ChatCompletionResponse,
        responses={200: {"content": _SSE}, **_ERRORS},
        summary="Chat with the model's chat template (stream: true for server-sent events)",
    )
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        _check_text(body)
        return await serving.chat(body, request)

    @app.post("/tokenize", response_model=TokenizeResponse, responses=_ERRORS)
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        """Token ids of a text or a conversation (vLLM's /tokenize)."""
        _check_text(body)
        serving.check_model(body.model)
        return tokenization.tokenize(body)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=_ERRORS)
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        """Text of token ids (vLLM's /detokenize)."""
        serving.check_model(body.model)
        return tokenization.detokenize(body)

    @app.get("/version", response_model=VersionResponse)
    async def get_version() -> dict[str, str]:
        return version()

    def model_card(name: str | None = None) -> dict[str, Any]:
        return {
            "id": name or settings.model_name,
            "object": "model",
            "created": created,
            "owned_by": "paged",
            "root": settings.model_name,
            "max_model_len": max_model_len,
        }

    @app.get("/v1/models", response_model=ModelList, responses={401: _ERRORS[401]})
    async def models() -> dict[str, Any]:
        names = (settings.model_name, *settings.model_aliases)
        return {"object": "list", "data": [model_card(name) for name in names]}

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=_ERRORS)
    async def model(model_id: str) -> dict[str, Any]:
        """One model (OpenAI's retrieve-model); 404 for any other id."""
        serving.check_model(model_id)
        return model_card(model_id)

    @app.get("/load")
    async def load() -> dict[str, int]:
        """Requests running or waiting (vLLM's server load, for load balancers)."""
        m = async_engine.metrics()
        return {"server_load": int(m.get("num_requests_running", 0) + m.get("num_requests_waiting", 0))}

    @app.get("/health", responses={503: {"description": "Engine dead or block audit failed"}})
    # /ping: the same check under SageMaker's and vLLM's name (not in the schema: an alias)
    @app.api_route("/ping", methods=["GET", "POST"], include_in_schema=False)
    async def health() -> JSONResponse:
        """200 when the engine thread answers and the KV block audit is clean
        (``/ping`` is the same check, as SageMaker and vLLM ask it)."""
        if not async_engine.alive:
            return _unhealthy(async_engine.last_error or "engine thread is not running")
        try:
            problems = await async_engine.call(engine.audit, timeout=HEALTH_TIMEOUT_S)
        except TimeoutError:
            return _unhealthy(f"engine thread did not answer within {HEALTH_TIMEOUT_S:.0f} s")
        except Exception as exc:
            return _unhealthy(f"audit failed: {type(exc).__name__}: {exc}")
        if problems:
            return _unhealthy("KV block audit found problems", audit=list(problems))
        return JSONResponse({"status": "ok", "audit": []})

    @app.get("/metrics", response_class=PlainTextResponse, responses={401: _ERRORS[401]})
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=METRICS_CONTENT_TYPE)

    @app.post(
        "/admin/reclaim",
        responses={401: _ERRORS[401], 403: {"description": "The server runs without an API key"}},
        summary="Free KV blocks the audit reports as leaked (operator action)",
    )
    async def reclaim() -> JSONResponse:
        """Reclaim leaked KV blocks (see docs/operations.md); the periodic audit
        only reports them. Served only when the server has an API key."""
        if settings.api_key is None:
            raise APIError(403, "admin endpoints need the server to run with --api-key")
        reclaimed = await async_engine.call(engine.reclaim_leaked, timeout=HEALTH_TIMEOUT_S)
        problems = await async_engine.call(engine.audit, timeout=HEALTH_TIMEOUT_S)
        return JSONResponse({"reclaimed_blocks": list(reclaimed), "audit": list(problems)})

    _document_400_not_422(app)
    # Outermost first: the key is checked before the body is read.
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=settings.max_body_bytes)
    open_paths = OPEN_PATHS if settings.metrics_need_api_key else OPEN_PATHS | {"/metrics"}
    app.add_middleware(APIKeyMiddleware, api_key=settings.api_key, open_paths=open_paths)
    if settings.allowed_origins:  # outermost: browsers' preflight requests carry no key
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.allowed_origins,
            allow_methods=settings.allowed_methods,
            allow_headers=settings.allowed_headers,
            allow_credentials=settings.allow_credentials,
        )
    return app


def _cache_config_info(metrics: ServerMetrics, engine: Any) -> None:
    """``paged:cache_config_info`` from the engine's settings and its pool."""
    config, capacity = engine.config, getattr(engine, "capacity", None)
    metrics.set_cache_config(
        block_size=str(config.block_size),
        num_gpu_blocks=str(getattr(capacity, "num_blocks", config.num_gpu_blocks)),
        cache_dtype=str(config.kv_cache_dtype),
        enable_prefix_caching=str(config.enable_prefix_caching),
        kv_cache_backend=str(config.kv_cache_backend),
        gpu_memory_utilization=str(config.gpu_memory_utilization),
    )


def _document_400_not_422(app: FastAPI) -> None:
    """FastAPI documents 422 for body errors; this server answers 400 (as
    OpenAI does), so the schema says 400 and drops the 422 entries."""
    original = app.openapi

    def openapi() -> dict[str, Any]:
        schema = original()
        for path in schema.get("paths", {}).values():
            for operation in path.values():
                operation.get("responses", {}).pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(name, None)
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


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


def _unhealthy(reason: str, **extra: Any) -> JSONResponse:
    return JSONResponse({"status": "unhealthy", "reason": reason, **extra}, status_code=503)


__all__ = ["APIError", "ServerSettings", "create_app"]
