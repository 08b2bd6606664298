"""What a CUDA graph cannot replay, checked as the ops run: ``GraphSafety``.

A captured graph replays fixed kernels on fixed addresses, so the pass it
records must never read a tensor's value on the host (a stall, and a value
frozen into the graph) nor make a tensor whose shape depends on values.
``GraphSafety`` is a dispatch mode that refuses those ops as they run, on
any device: the decode graphs' static path runs under it with
``PAGED_DECODE_GRAPHS=check`` (every rank of a parallel engine), and the
tests run it on a CPU, where no graph can be captured.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Ops that read a tensor's value on the host, or whose output shape depends on
# values: either stalls a GPU stream or cannot be replayed from a graph.
FORBIDDEN = frozenset({
    "aten._local_scalar_dense",  # .item(), int(t), bool(t), float(t)
    "aten.item",  # the same under inference mode
    "aten.is_nonzero",
    "aten.equal",
    "aten.nonzero",
    "aten.masked_select",
    "aten._unique2",
    "aten.unique_dim",
    "aten.unique_consecutive",
})


class GraphSafety(TorchDispatchMode):
    """Refuses the ``FORBIDDEN`` ops (and ``repeat_interleave`` without a
    static output size) with ``GraphUnsafeError``; with ``record``, keeps
    every op run and its output shapes in ``trace`` (two steps that differ
    only in values must trace alike)."""

    def __init__(self, record: bool = False) -> None:
        super().__init__()
        self.record = record
        self.trace: list[tuple[str, tuple[tuple[int, ...], ...]]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = str(func.overloadpacket)
        if name in FORBIDDEN or (
            name == "aten.repeat_interleave" and (kwargs or {}).get("output_size") is None
        ):
            raise GraphUnsafeError(f"{name} in a pass a CUDA graph would replay")
        out = func(*args, **(kwargs or {}))
        if self.record:
            outs = out if isinstance(out, tuple | list) else [out]
            self.trace.append((name, tuple(tuple(o.shape) for o in outs if isinstance(o, torch.Tensor))))
        return out


class GraphUnsafeError(RuntimeError):
    """An op a CUDA graph cannot replay ran in a pass meant for one."""
