"""The dense weight of a quantized layer, in one pass: ``dequant(qweight)``
as ``[N, K]`` in the activations' dtype.

For many rows (prefill) the dequantizing GEMM (``quant_matmul``) loses to
cuBLAS: it is bound by arithmetic there, and its tiles go through registers
to be dequantized. vLLM's AWQ and exllama paths then dequantize the weight
into a temporary dense buffer and call the 16-bit matmul; this is that
dequantize step, one read of the codes and one write of the dense weight
(the tensor-op version in ``QuantizedLinear.dequantized_weight`` takes five
passes). The values are the GEMM's to the bit: ``(code - zero) * scale`` in
float32, rounded once to the dtype.

The layout is ``quant_matmul``'s (its module docstring).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from paged_triton.interpreter_bf16 import cast
from paged_triton.launch import Launch
from paged_triton.launch_checks import check_runnable, interpreted
from paged_triton.quant_matmul import ACT_DTYPES, QuantWeight, block_k_for, ceil_div

BLOCK_N = 64
BLOCK_K = 128  # preferred; smaller for groups it does not divide (block_k_for)


@triton.jit
def _dequantize_kernel(
    W,  # [N, K] int8, or [N, K // 2] uint8 (4-bit: two codes per byte)
    S,  # [N, K // group_size] float32
    Z,  # like S, int8 (HAS_ZEROS), else any pointer
    OUT,  # [N, K] in the activations' dtype
    N,
    K,
    group_size,
    stride_wn,
    stride_sn,
    stride_on,
    BITS: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    kk = k0 + tl.arange(0, BLOCK_K)
    n_ok = n < N
    n64 = n.to(tl.int64)
    if BITS == 8:
        q = tl.load(
            W + n64[:, None] * stride_wn + kk[None, :],
            mask=n_ok[:, None] & (kk < K)[None, :],
            other=0,
        ).to(tl.float32)
    else:
        kp = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        packed = tl.load(
            W + n64[:, None] * stride_wn + kp[None, :],
            mask=n_ok[:, None] & (kp < K // 2)[None, :],
            other=0x88,
        )
        low = (packed & 0xF).to(tl.float32) - 8.0
        high = (packed >> 4).to(tl.float32) - 8.0
        q = tl.reshape(tl.join(low, high), (BLOCK_N, BLOCK_K))  # feature 2j low, 2j + 1 high
    group = k0 // group_size  # a tile never straddles two groups
    scale = tl.load(S + n64 * stride_sn + group, mask=n_ok, other=0.0)
    if HAS_ZEROS:
        zero = tl.load(Z + n64 * stride_sn + group, mask=n_ok, other=0).to(tl.float32)
        q = q - zero[:, None]
    w = cast(q * scale[:, None], OUT.dtype.element_ty, EMULATE_BF16)
    mask = n_ok[:, None] & (kk < K)[None, :]
    tl.store(OUT + n64[:, None] * stride_on + kk[None, :], w, mask=mask)


def plan_dequantize(w: QuantWeight, out: Tensor, interpret: bool = False) -> Launch:
    """The launch writing ``dequant(w)`` into ``out`` (``[N, K]``, the
    activations' dtype). Reads no tensor (meta tensors plan)."""
    n, k = out.shape
    block_k = block_k_for(w.group_size, k, BLOCK_K)
    assert block_k is not None, (w.group_size, k)
    return Launch(
        _dequantize_kernel,
        (ceil_div(n, BLOCK_N), ceil_div(k, block_k)),
        (
            w.qweight, w.scales, w.zeros if w.zeros is not None else w.scales, out,
            n, k, w.group_size, w.qweight.stride(0), w.scales.stride(0), out.stride(0),
        ),  # fmt: skip
        dict(
            BITS=w.bits,
            HAS_ZEROS=w.zeros is not None,
            EMULATE_BF16=interpret and out.dtype == torch.bfloat16,
            BLOCK_N=BLOCK_N,
            BLOCK_K=block_k,
        ),
        num_warps=4,
        num_stages=1,
    )


def dequantize(w: QuantWeight, dtype: torch.dtype) -> Tensor:
    """The dense ``[N, K]`` weight in ``dtype`` (a fresh tensor), as
    ``quant_matmul`` multiplies by it."""
    check_runnable(_dequantize_kernel, w.qweight, w.scales)
    if dtype not in ACT_DTYPES:
        raise ValueError(f"dtype must be one of {ACT_DTYPES}, got {dtype}")
    n, k = w.scales.shape[0], w.in_features
    out = torch.empty(n, k, dtype=dtype, device=w.qweight.device)
    if n and k:
        plan_dequantize(w, out, interpreted(_dequantize_kernel)).run()
    return out
