"""The Triton attention backend: ``paged_triton.ops``' fused kernels.

CUDA's backend (``auto`` picks it there), or a CPU's under Triton's
interpreter (``TRITON_INTERPRET=1``, for tests). Its kernels never sync
with the host, so decode steps replay as CUDA graphs; each variant
compiles on first launch, so the engine warms them all up first
(``paged_triton.warmup``). This module imports triton only when a
backend is built, so the engine can read the flags first.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from paged_ref.ops_backend import OpsBackend


class TritonBackend(OpsBackend):
    """``paged_triton.ops`` as an ``AttentionBackend`` (see module doc)."""

    name = "triton"
    device_types: tuple[str, ...] = ("cuda",)
    auto_for: tuple[str, ...] = ("cuda",)
    graph_safe = True
    needs_warmup = True

    def __init__(self, ops: Any = None) -> None:
        if ops is None:
            from paged_triton import ops
        super().__init__(ops)

    @classmethod
    def unavailable(cls, device_type: str) -> str | None:
        """CUDA, or a CPU under Triton's interpreter."""
        if device_type == "cuda" or os.environ.get("TRITON_INTERPRET", "0") == "1":
            return None
        return (
            "attention_backend: 'triton' needs a CUDA device; on CPU set TRITON_INTERPRET=1 "
            "(Triton's slow interpreter, for testing) or use 'ref'"
        )

    def warm_up(self, layout: Any, device: torch.device) -> Any:
        """Compile every kernel variant ``layout`` launches (``paged_triton.warmup``)."""
        from paged_triton.warmup import warm_up

        return warm_up(layout, device)

    def lora_ops(self, device_type: str) -> Any:
        """Triton's LoRA kernels on CUDA (the interpreter's would be slow)."""
        if device_type != "cuda":
            return None
        from paged_triton import lora_ops

        return lora_ops

    def layer_ops(self, device_type: str) -> Any:
        """Triton's fused RMSNorm, RoPE and SiLU-mul on CUDA, where each eager
        op is a kernel of its own (the interpreter's would be slow)."""
        if device_type != "cuda":
            return None
        from paged_triton import layer_ops

        return layer_ops
