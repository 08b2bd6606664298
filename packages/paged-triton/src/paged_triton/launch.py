"""One kernel launch as data.

Each op's wrapper *plans* its launches (grid, arguments, constexprs, warps,
stages) in a pure host function and then runs them. The compile matrix
(``compile_matrix.py``) calls the same planning functions on ``meta``
tensors, so what it compiles ahead of time for a GPU is exactly what the
ops would launch there, down to Triton's specialisation of each argument.
Within one step, a :class:`Replay` kept in the step's ``memo`` lets every
layer after the first skip the checks and the planning.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
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

    def run(self, args: tuple[Any, ...] | list[Any] | None = None) -> None:
        """Launch (with ``args`` instead of the planned arguments if given)."""
        self.kernel[self.grid](
            *(self.args if args is None else args), **self.constexprs, **self.options
        )


@dataclass(slots=True)
class Replay:
    """A layer's planned launches, replayed for the next layers of the same
    step with only their own tensors swapped in (the ops keep it in the
    step's ``memo``): every layer of a step has the same shapes, block
    tables and lengths, so checks and planning run once per step, not once
    per layer. ``where[i]`` gives, for launch ``i``, the argument position
    of each per-layer tensor (-1: not an argument of that launch)."""

    launches: Sequence[Launch]
    where: Sequence[tuple[int, ...]]

    def run(self, *tensors: Any) -> None:
        for launch, positions in zip(self.launches, self.where, strict=True):
            args = list(launch.args)
            for position, tensor in zip(positions, tensors, strict=True):
                if position >= 0:
                    args[position] = tensor
            launch.run(args)


def tensor_key(t: torch.Tensor) -> tuple[Any, ...]:
    """What a planned launch assumed about ``t``: shape, strides, dtype, device."""
    return (t.shape, t.stride(), t.dtype, t.is_cuda, t.get_device())


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
