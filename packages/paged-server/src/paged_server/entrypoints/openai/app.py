"""The FastAPI app: its routers, guards, and the engine thread's lifetime.

``create_app(engine, settings, thread)`` takes an engine that is already
built (the model loaded), so a bad model path fails before the server binds
a port, and the `EngineThread` that built it, which then steps it.
The engine thread starts with the app and stops on shutdown, aborting what
is still in flight and closing its streams. The routes live on two
routers: ``api_routes.py`` (what clients call) and ``ops_routes.py`` (what
operators and load balancers call).
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from paged_server import start_up_heap
from paged_server.entrypoints.openai.api_routes import api_router
from paged_server.entrypoints.openai.async_engine import AsyncEngine, EngineLike, EngineThread
from paged_server.entrypoints.openai.chat_page import PAGE_PATH, chat_page_router
from paged_server.entrypoints.openai.errors import APIError, install_error_handlers
from paged_server.entrypoints.openai.lora_routes import lora_router, runtime_lora_updating
from paged_server.entrypoints.openai.messages_bodies import anthropic_error_body
from paged_server.entrypoints.openai.metrics import ServerMetrics
from paged_server.entrypoints.openai.middleware import (
    DEFAULT_MAX_BODY_BYTES,
    OPEN_PATHS,
    APIKeyMiddleware,
    BodySizeLimitMiddleware,
)
from paged_server.entrypoints.openai.ops_routes import ops_router
from paged_server.entrypoints.openai.pooling_serving import OpenAIPooling
from paged_server.entrypoints.openai.read_timeout import DEFAULT_REQUEST_READ_TIMEOUT_S
from paged_server.entrypoints.openai.serving import OpenAIServing
from paged_server.entrypoints.openai.stats_logger import StatsLogger
from paged_server.entrypoints.openai.tokenization import Tokenization


@dataclass(slots=True)
class ServerSettings:
    """HTTP-side settings (the engine's are in ``EngineConfig``)."""

    model_name: str
    model_aliases: tuple[str, ...] = ()  # more names clients may send (--served-model-name a b)
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    shutdown_timeout_s: float = 30.0
    audit_interval_s: float = 60.0  # KV audit while idle (0 = never)
    request_read_timeout_s: float = DEFAULT_REQUEST_READ_TIMEOUT_S  # a whole request must arrive within
    timeout_keep_alive_s: int = 5  # an idle kept-alive connection closes after (uvicorn's)
    announce: bool = False  # print start/stop lines (the CLI server does; test servers don't)
    tool_call_parser: str | None = None  # None: detected from the chat template
    enable_auto_tool_choice: bool = True  # False: tool_choice "auto" is a 400 (vLLM's default)
    reasoning_parser: str | None = None  # reasoning.REASONING_PARSERS
    chat_template: str | None = None  # replaces the tokenizer's
    trust_request_chat_template: bool = False  # False: a request's chat_template is a 400 (vLLM)
    chat_template_timeout_s: float = 10.0  # a render past it is a 400, and stopped
    response_role: str = "assistant"
    return_tokens_as_token_ids: bool = False  # the default of the request field of that name
    log_requests: bool = False  # one log line per request
    log_stats: bool = False  # the periodic stats line (the CLI turns it on)
    metrics_need_api_key: bool = False  # /metrics is open by default, as vLLM's
    allowed_origins: list[str] | None = None  # CORS; None: no CORS headers
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False
    root_path: str = ""  # behind a proxy that strips a prefix
    enable_web_ui: bool = True  # the chat page at / (chat_page.py)
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None


def create_app(
    engine: EngineLike, settings: ServerSettings, thread: EngineThread | None = None
) -> FastAPI:
    """The OpenAI-compatible app around ``engine`` (an ``LLMEngine``), stepped
    on ``thread``: the one that built it (``server.build_engine``), else a new one."""
    config = engine.config
    metrics = ServerMetrics(settings.model_name, config.max_model_len)
    _cache_config_info(metrics, engine)
    async_engine = AsyncEngine(
        engine, metrics, audit_interval_s=settings.audit_interval_s, thread=thread,
        stats_logger=StatsLogger() if settings.log_stats else None,
    )
    serving = OpenAIServing(
        async_engine,
        engine.tokenizer,
        model_name=settings.model_name,
        max_model_len=config.max_model_len,
        tool_call_parser=settings.tool_call_parser,
        settings=settings,
        max_logprobs=config.max_logprobs,
        default_sampling=engine.default_sampling,
    )
    tokenization = Tokenization(engine.tokenizer, config.max_model_len, serving.renderer.messages_ids)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.loop = asyncio.get_running_loop()  # for checks of leftover tasks
        async_engine.start()
        start_up_heap.freeze()
        try:
            yield
        finally:
            start_up_heap.unfreeze()
            await asyncio.to_thread(async_engine.stop, settings.shutdown_timeout_s)
            await asyncio.to_thread(engine.shutdown)  # tensor-parallel workers exit with the server
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
    install_error_handlers(app, shapes={"/v1/messages": anthropic_error_body})
    names = (settings.model_name, *settings.model_aliases)
    pooling = OpenAIPooling(async_engine, engine.tokenizer, getattr(engine, "pooler", None), serving)
    app.include_router(api_router(serving, tokenization, names, config.max_model_len, pooling=pooling))
    app.include_router(ops_router(engine, async_engine, metrics, settings.api_key))
    if runtime_lora_updating():  # vLLM's opt-in for loading adapters at run time
        app.include_router(lora_router(async_engine))
    if settings.enable_web_ui:
        app.include_router(chat_page_router(embedded_model=not config.model))
    _document_400_not_422(app)
    # Outermost first: the key is checked before the body is read.
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=settings.max_body_bytes)
    open_paths = OPEN_PATHS if settings.metrics_need_api_key else OPEN_PATHS | {"/metrics"}
    if settings.enable_web_ui:  # the page holds no secret; it asks for the key the API needs
        open_paths |= {PAGE_PATH}
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


def _cache_config_info(metrics: ServerMetrics, engine: EngineLike) -> None:
    """``paged:cache_config_info`` from the engine's settings and its pool."""
    config = engine.config
    metrics.set_cache_config(
        block_size=str(config.block_size),
        num_gpu_blocks=str(engine.capacity.num_blocks),
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


__all__ = ["APIError", "ServerSettings", "create_app"]
