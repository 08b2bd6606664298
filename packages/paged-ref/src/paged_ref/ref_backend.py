"""The reference attention backend: ``paged_ref.ops`` (gather, then SDPA).

Runs on any device and defines the semantics every other backend is
tested against. Its ops sync with the host (no CUDA graphs); a CPU pass
over it may be compiled, and then reads the paged cache with the C kernels
(``compiled_variant``: ``cpu.cpu_backend``).
"""

from __future__ import annotations

from typing import Any

from paged_ref import ops as ref_ops
from paged_ref.ops_backend import OpsBackend


class RefBackend(OpsBackend):
    """``paged_ref.ops`` as an ``AttentionBackend``; ``auto`` picks it on a CPU."""

    name = "ref"
    device_types: tuple[str, ...] = ("cpu", "cuda")
    auto_for: tuple[str, ...] = ("cpu",)
    compilable = True
    compiled_variant: str | None = "cpu"

    def __init__(self, ops: Any = None) -> None:
        super().__init__(ref_ops if ops is None else ops)
