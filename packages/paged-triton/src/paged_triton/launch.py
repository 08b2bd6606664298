"""One kernel launch as data.

Each op's wrapper *plans* its launches (grid, arguments, constexprs, warps,
stages) in a pure host function and then runs them. The compile matrix
(``compile_matrix.py``) calls the same planning functions on ``meta``
tensors, so what it compiles ahead of time for a GPU is exactly what the
ops would launch there, down to Triton's specialisation of each argument.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(slots=True)
class Launch:
    """``kernel[grid](*args, **constexprs, num_warps=..., num_stages=...)``
    (and ``maxnreg``, a register cap per thread, when set)."""

    kernel: Any  # a triton JITFunction, or InterpretedFunction under TRITON_INTERPRET=1
    grid: tuple[int, ...]
    args: tuple[Any, ...]
    constexprs: dict[str, Any]
    num_warps: int
    num_stages: int
    maxnreg: int | None = None

    @property
    def options(self) -> dict[str, int]:
        """Compiler options: what ``triton.compile`` takes besides the source."""
        out = {"num_warps": self.num_warps, "num_stages": self.num_stages}
        if self.maxnreg is not None:
            out["maxnreg"] = self.maxnreg
        return out

    def run(self) -> None:
        self.kernel[self.grid](*self.args, **self.constexprs, **self.options)


def device_arch(device: torch.device) -> int | None:
    """Compute capability as ``10 * major + minor`` (80, 89, 90, ...) for a
    CUDA device; ``None`` elsewhere (Triton's CPU interpreter)."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_arch(index)


@functools.cache
def _cuda_arch(index: int) -> int:
    major, minor = torch.cuda.get_device_capability(index)
    return 10 * major + minor
