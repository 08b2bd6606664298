"""bfloat16 as a GPU computes it, also under Triton's CPU interpreter.

The interpreter loads and stores bfloat16 exactly, but its ``tl.dot`` on
bfloat16 operands returns garbage and its float32 -> bfloat16 cast
truncates where a GPU rounds to nearest even. The kernels route their
products and downcasts through :func:`dot` and :func:`cast`; with
``EMULATE_BF16`` (a constexpr the wrappers set only when interpreting
bfloat16) these do on the CPU what the GPU does: exact products of the
16-bit operands accumulated in float32, and round-to-nearest-even casts.
Compiled for a GPU, ``EMULATE_BF16`` is False and both are the plain ops.

The same holds for fp8 stores: the interpreter's float32 -> fp8 cast drops
the carry when rounding up crosses a power of two (1.97 becomes 1.0, not
2.0). :func:`round_to_fp8` rounds to the fp8 grid in float32 first (to
nearest even, as a GPU's ``cvt.rn`` does), so the cast after it is exact.
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


@triton.jit
def round_to_fp8(x, MANTISSA_BITS: tl.constexpr, MIN_NORMAL_EXP: tl.constexpr):
    """float32 ``x`` (already within the format's range) rounded to the
    nearest fp8 value with ``MANTISSA_BITS`` (3: e4m3, 2: e5m2), ties to even;
    below ``2**MIN_NORMAL_EXP`` (-6: e4m3, -14: e5m2) onto the subnormal grid."""
    drop: tl.constexpr = 23 - MANTISSA_BITS
    bits = x.to(tl.uint32, bitcast=True)
    bits = ((bits + ((1 << (drop - 1)) - 1) + ((bits >> drop) & 1)) >> drop) << drop
    normal = bits.to(tl.float32, bitcast=True)
    # Subnormals: a fixed step of 2**(MIN_NORMAL_EXP - MANTISSA_BITS); adding and
    # subtracting 1.5 * 2**23 steps rounds to a multiple of it, ties to even
    # (on the magnitude, so a value that rounds to zero keeps its sign: -0).
    magic: tl.constexpr = 1.5 * 2.0 ** (23 + MIN_NORMAL_EXP - MANTISSA_BITS)
    sub = (tl.abs(x) + magic) - magic
    sub = tl.where(x < 0, -sub, sub)
    return tl.where(tl.abs(x) < 2.0**MIN_NORMAL_EXP, sub, normal)
