"""bfloat16 as a GPU computes it, also under Triton's CPU interpreter.

The interpreter loads and stores bfloat16 exactly, but its ``tl.dot`` on
bfloat16 operands returns garbage and its float32 -> bfloat16 cast
truncates where a GPU rounds to nearest even. The kernels route their
products and downcasts through :func:`dot` and :func:`cast`; with
``EMULATE_BF16`` (a constexpr the wrappers set only when interpreting
bfloat16) these do on the CPU what the GPU does: exact products of the
16-bit operands accumulated in float32, and round-to-nearest-even casts.
Compiled for a GPU, ``EMULATE_BF16`` is False and both are the plain ops.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def dot(a, b, PRECISION: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """``tl.dot(a, b)`` (float32 result)."""
    if EMULATE_BF16:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a, b, input_precision=PRECISION)
    return out


@triton.jit
def cast(x, dtype: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """``x.to(dtype)``, rounding to nearest even into bfloat16."""
    if EMULATE_BF16 and dtype == tl.bfloat16 and x.dtype != tl.bfloat16:
        bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        out = bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        out = x.to(dtype)
    return out
