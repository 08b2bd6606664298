"""vLLM's LoRA adapter routes: ``POST /v1/load_lora_adapter`` and
``/v1/unload_lora_adapter``, served (behind the API key, as every route)
only when the environment sets ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` true, as
vLLM does: loading code-free weights from a path the client names is an
operator's choice. Bodies, status codes and plain-text answers are vLLM's.

An adapter loaded here is served under ``lora_name`` as a request's
``model`` and listed by ``/v1/models``; an unload lets the requests already
using it finish (new ones get 404) and frees its weights after them.
"""

from __future__ import annotations

import os
from typing import Any

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse

from paged_server.entrypoints.openai.api_routes import ERRORS
from paged_server.entrypoints.openai.async_engine import AsyncEngine
from paged_server.entrypoints.openai.errors import APIError
from paged_server.entrypoints.openai.protocol import _Strict
from paged_server.lora_request import LoRARequest

RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_lora_updating() -> bool:
    """vLLM's switch: the routes exist only when it reads true (``1``/``true``)."""
    return os.environ.get(RUNTIME_LORA_ENV, "").strip().lower() in ("1", "true")


class LoadLoRAAdapterRequest(_Strict):
    lora_name: str
    lora_path: str
    load_inplace: bool = False  # vLLM: replace an adapter of that name


class UnloadLoRAAdapterRequest(_Strict):
    lora_name: str
    lora_int_id: int | None = None


def lora_router(async_engine: AsyncEngine) -> APIRouter:
    """The two routes over the engine's adapters (every call on the engine thread)."""
    router = APIRouter()
    engine: Any = async_engine.engine  # an LLMEngine (--enable-lora): add_lora, remove_lora

    @router.post("/v1/load_lora_adapter", response_class=PlainTextResponse, responses=ERRORS)
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> PlainTextResponse:
        """Load the PEFT adapter at ``lora_path`` as ``lora_name`` (every tensor-parallel rank its shard)."""
        name = body.lora_name
        if not name or not body.lora_path:
            raise APIError(400, "Both 'lora_name' and 'lora_path' must be provided.", param="lora_name")
        served = getattr(engine, "lora_requests", {})
        if name in served and not body.load_inplace:
            raise APIError(400, f"The lora adapter '{name}' has already been loaded.", param="lora_name")

        def load() -> None:
            if name in served and body.load_inplace:
                engine.remove_lora(name)
            ids = [r.lora_int_id for r in served.values()]
            engine.add_lora(LoRARequest(name, max(ids, default=0) + 1, body.lora_path))

        try:
            await async_engine.call(load)
        except ValueError as exc:
            raise APIError(400, str(exc), param="lora_path") from None
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse, responses=ERRORS)
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        """Stop serving ``lora_name``; requests already using it finish first."""
        name = body.lora_name

        def unload() -> bool:
            if name not in getattr(engine, "lora_requests", {}):
                return False
            engine.remove_lora(name)
            return True

        if not await async_engine.call(unload):
            raise APIError(404, f"The lora adapter '{name}' cannot be found.", param="lora_name",
                           code="not_found")  # fmt: skip
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    return router
