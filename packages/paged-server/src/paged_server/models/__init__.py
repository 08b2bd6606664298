"""Model code (Llama, Qwen 3, Gemma 3) and the Hugging Face directory loader.

``load_model(path, dtype, device)`` returns a ``LoadedModel``; the model's
``forward(input_ids, position_ids, kv_cache=None)`` gives float32 logits and
talks to the KV cache only through ``AttentionViewProtocol.attend``.
"""

from __future__ import annotations

from paged_server.models.base import CausalLM
from paged_server.models.config import ModelConfig, RopeParams
from paged_server.models.errors import (
    CheckpointMismatchError,
    InvalidConfigError,
    ModelFileNotFoundError,
    ModelLoadError,
    UnsupportedArchitectureError,
)
from paged_server.models.loader import LoadedModel, load_model
from paged_server.models.registry import SUPPORTED_ARCHITECTURES

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "CausalLM",
    "CheckpointMismatchError",
    "InvalidConfigError",
    "LoadedModel",
    "ModelConfig",
    "ModelFileNotFoundError",
    "ModelLoadError",
    "RopeParams",
    "UnsupportedArchitectureError",
    "load_model",
]
