"""paged-server: models, engine and the OpenAI-compatible HTTP server.

``from paged_server import LLM, SamplingParams`` for offline generation;
the names load lazily so that ``import paged_server`` stays cheap.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from paged_server.config import EngineConfig
    from paged_server.engine.core.llm_engine import LLMEngine
    from paged_server.entrypoints.llm import LLM
    from paged_server.lora_request import LoRARequest
    from paged_server.outputs import BeamSearchOutput, CompletionResult, RequestOutput
    from paged_server.sampling_params import BeamSearchParams, SamplingParams

_EXPORTS = {
    "EngineConfig": "paged_server.config",
    "LLMEngine": "paged_server.engine.core.llm_engine",
    "LLM": "paged_server.entrypoints.llm",
    "CompletionResult": "paged_server.outputs",
    "RequestOutput": "paged_server.outputs",
    "SamplingParams": "paged_server.sampling_params",
    "BeamSearchParams": "paged_server.sampling_params",
    "BeamSearchOutput": "paged_server.outputs",
    "LoRARequest": "paged_server.lora_request",
}

__all__ = [
    "LLM",
    "BeamSearchOutput",
    "BeamSearchParams",
    "CompletionResult",
    "EngineConfig",
    "LLMEngine",
    "LoRARequest",
    "RequestOutput",
    "SamplingParams",
]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'paged_server' has no attribute {name!r}")
