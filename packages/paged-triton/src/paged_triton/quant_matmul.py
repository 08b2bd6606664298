"""Weight-only quantized GEMM: ``y = x @ dequant(w).T``, the weight
dequantized tile by tile in registers, never as a whole matrix in memory.

The GPU path of ``paged_server``'s ``QuantizedLinear`` (int8 and int4
weights; fp8 keeps dequantize-then-matmul). The weight is read in the
layout the layer stores it in (one layout for every checkpoint format):

- ``qweight``: 8-bit: ``[N, K]`` int8 codes; 4-bit: ``[N, K // 2]`` uint8,
  two codes per byte, input feature ``2j`` in the low nibble and ``2j + 1``
  in the high one, each stored as ``code + 8`` (0..15);
- ``scales``: ``[N, K // group_size]`` float32;
- ``zeros``: like ``scales``, int8 (asymmetric formats), or ``None``;

and ``w[n, k] = (code - zero) * scale`` of ``k``'s group. Inside the K loop
a program loads the packed tile, unpacks the nibbles, subtracts the zero
point, multiplies by its group's scale (a tile never straddles two groups:
``BLOCK_K`` divides ``group_size``), casts to the activations' dtype and
runs ``tl.dot`` with a float32 accumulator.

Few output tiles (decode: one 16-row tile of M) cannot fill a GPU, so the
K loop is then split over programs (split-K) whose float32 partials are
summed. Which split and tile a layer gets depends on its N and K and on
the bucket of M (<= 16, <= 64, more), never on the exact M, so a step's
token count changes no compiled variant within a bucket.

From :data:`DENSE_ROWS` rows on (prefill) the layer does not call this
kernel: it dequantizes the weight once (``quant_dequantize``) and lets
cuBLAS multiply, as vLLM's AWQ path does from 256 rows (:func:`prefers_dense`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from paged_triton.interpreter_bf16 import cast, dot
from paged_triton.launch import Launch
from paged_triton.launch_checks import check_runnable, dot_precision, interpreted

ACT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SPLIT_WAVES = 2  # split-K aims at this many programs per SM
MIN_SPLIT_TILES = 4  # K tiles each split keeps, so its loop still pipelines
# Rows from which dequantize-then-cuBLAS beats this kernel: at prefill sizes
# cuBLAS's dense GEMM outruns it by more than one pass over the weight costs
# (benchmarks/test_quant_matmul_bench.py measures both); vLLM's AWQ path
# switches at the same 256.
DENSE_ROWS = 256


class QuantWeight(NamedTuple):
    """A quantized ``[N, K]`` weight in this module's layout (its docstring),
    as ``QuantizedLinear`` stores it: one argument for the kernels' wrappers."""

    qweight: Tensor
    scales: Tensor
    zeros: Tensor | None
    bits: int
    group_size: int

    @property
    def in_features(self) -> int:
        return self.qweight.shape[1] * (2 if self.bits == 4 else 1)


def prefers_dense(rows: int) -> bool:
    """Whether ``rows`` rows of x are better served by dequantizing the
    weight into a dense buffer and a 16-bit matmul than by this kernel."""
    return rows >= DENSE_ROWS


@dataclass(frozen=True, slots=True)
class QuantTile:
    """Rows of x (``block_m``), output features (``block_n``) and input
    features (``block_k``) per program step; warps, pipeline stages and
    the register cap per thread (``None``: ptxas's choice)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    maxnreg: int | None = None


# M bucket -> tile. <= 16 rows: decode, bound by reading the weight (deep
# pipeline, long K tiles); <= 64: small batches; more: prefill, bound by
# arithmetic (8 warps on 128 x 128 outputs). From the compile matrix: left
# to itself ptxas gave the 4-warp split-K int8 tile 80 registers and spilled
# 16 B on sm_90, and capped at 128 it spilled 16 B of the int4 asym tile;
# with 168 (3 blocks per SM) nothing spills on sm_80/89/90.
_TILES = (
    (16, QuantTile(16, 64, 128, 4, 4, 168)),
    (64, QuantTile(64, 64, 64, 4, 4, 168)),
    (None, QuantTile(128, 128, 64, 8, 3)),
)


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` for host code: ``triton.cdiv`` is a constexpr function
    whose call costs microseconds (six of them were a third of this
    wrapper's host time)."""
    return -(-a // b)


def block_k_for(group_size: int, in_features: int, preferred: int) -> int | None:
    """The K tile for ``group_size``: ``preferred`` or the largest power of
    two below it (>= 16) that divides the group, so no tile spans two
    groups; a single group (per-channel) takes ``preferred`` (the tail is
    masked). ``None``: no such tile (the caller dequantizes instead)."""
    if group_size >= in_features:
        return preferred
    block = preferred
    while block >= 16:
        if group_size % block == 0:
            return block
        block //= 2
    return None


def supports(bits: int, group_size: int, in_features: int) -> str | None:
    """Why this kernel cannot run a weight of this form (``None``: it can)."""
    if bits not in (4, 8):
        return f"{bits}-bit weights (the kernel takes 4 and 8)"
    if bits == 4 and in_features % 2:
        return f"4-bit weights with an odd number of input features ({in_features})"
    if block_k_for(group_size, in_features, 16) is None:
        return f"group size {group_size} (not a multiple of 16)"
    return None


def _bucket(m: int) -> int:
    """One row count for ``m``'s whole tile bucket (the bucket's largest;
    past the last limit, the smallest), so caches keyed by it stay small."""
    small = [limit for limit, _ in _TILES if limit is not None]
    return next((limit for limit in small if m <= limit), small[-1] + 1)


def tile_for(m: int, group_size: int, in_features: int) -> QuantTile:
    """The tile for ``m`` rows of x (its bucket) and the weight's groups."""
    tile = next(t for limit, t in _TILES if limit is None or m <= limit)
    block_k = block_k_for(group_size, in_features, tile.block_k)
    assert block_k is not None, (group_size, in_features)
    return replace(tile, block_k=block_k)


def split_k(tile: QuantTile, m: int, n: int, k: int, sms: int | None) -> int:
    """How many programs share each output tile's K loop: enough to give
    ``sms`` SMs :data:`SPLIT_WAVES` programs each when the output tiles
    alone cannot, each split keeping :data:`MIN_SPLIT_TILES` K tiles; 1 on
    the prefill bucket (its M tiles vary per step, so would the split) and
    without a GPU (``sms=None``)."""
    if sms is None or tile.block_m > _TILES[1][0]:  # type: ignore[operator]
        return 1
    tiles = ceil_div(n, tile.block_n)  # one M tile in the small buckets
    k_tiles = ceil_div(k, tile.block_k)
    want = ceil_div(SPLIT_WAVES * sms, tiles)
    return max(1, min(want, k_tiles // MIN_SPLIT_TILES))


@triton.jit(do_not_specialize=["M"])
def _quant_matmul_kernel(
    X,  # [M, K] fp16/bf16/fp32
    W,  # [N, K] int8, or [N, K // 2] uint8 (4-bit: two codes per byte)
    S,  # [N, K // group_size] float32
    Z,  # like S, int8 (HAS_ZEROS), else any pointer
    Y,  # [M, N] in X's dtype, or [splits, M, N] float32 partials
    M,
    N,
    K,
    group_size,
    k_per_split,  # input features per split (a multiple of BLOCK_K)
    stride_xm,
    stride_wn,
    stride_sn,
    stride_ym,
    stride_ys,
    BITS: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    PRECISION: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = m < M
    n_ok = n < N
    n64 = n.to(tl.int64)
    x_rows = X + m.to(tl.int64)[:, None] * stride_xm
    k_begin = pid_k * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_rows + kk[None, :], mask=m_ok[:, None] & (kk < K)[None, :], other=0.0)
        if BITS == 8:
            q = tl.load(
                W + n64[None, :] * stride_wn + kk[:, None],
                mask=n_ok[None, :] & (kk < K)[:, None],
                other=0,
            ).to(tl.float32)  # [BLOCK_K, BLOCK_N]
        else:
            kp = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            packed = tl.load(
                W + n64[:, None] * stride_wn + kp[None, :],
                mask=n_ok[:, None] & (kp < K // 2)[None, :],
                other=0x88,  # codes 0 beyond the edge
            )  # [BLOCK_N, BLOCK_K // 2]
            low = (packed & 0xF).to(tl.float32) - 8.0
            high = (packed >> 4).to(tl.float32) - 8.0
            # Interleave: feature 2j from the low nibble, 2j + 1 from the high one.
            q = tl.trans(tl.reshape(tl.join(low, high), (BLOCK_N, BLOCK_K)))
        group = k0 // group_size
        scale = tl.load(S + n64 * stride_sn + group, mask=n_ok, other=0.0)
        if HAS_ZEROS:
            zero = tl.load(Z + n64 * stride_sn + group, mask=n_ok, other=0).to(tl.float32)
            q = q - zero[None, :]
        w = cast(q * scale[None, :], X.dtype.element_ty, EMULATE_BF16)
        acc += dot(x, w, PRECISION, EMULATE_BF16)
    out = Y + pid_k.to(tl.int64) * stride_ys + m.to(tl.int64)[:, None] * stride_ym + n[None, :]
    tl.store(out, cast(acc, Y.dtype.element_ty, EMULATE_BF16), mask=m_ok[:, None] & n_ok[None, :])


def plan_quant_matmul(
    x: Tensor, w: QuantWeight, out: Tensor, splits: int, tile: QuantTile, interpret: bool = False
) -> Launch:
    """The launch computing ``x [M, K] @ dequant(w).T`` into ``out``:
    ``[M, N]`` in x's dtype when ``splits == 1``, else ``[splits, M, N]``
    float32 partials (to be summed). Reads no tensor (meta tensors plan)."""
    m, k = x.shape
    n = w.scales.shape[0]
    k_tiles = ceil_div(k, tile.block_k)
    k_per_split = ceil_div(k_tiles, splits) * tile.block_k
    splits = ceil_div(k, k_per_split)  # no empty split
    assert splits == 1 or out.dim() == 3, "split-K writes float32 partials [splits, M, N]"
    grid = (ceil_div(m, tile.block_m), ceil_div(n, tile.block_n), splits)
    return Launch(
        _quant_matmul_kernel,
        grid,
        (
            x, w.qweight, w.scales, w.zeros if w.zeros is not None else w.scales, out,
            m, n, k, w.group_size, k_per_split,
            x.stride(0), w.qweight.stride(0), w.scales.stride(0), out.stride(-2),
            out.stride(0) if out.dim() == 3 else 0,
        ),  # fmt: skip
        dict(
            BITS=w.bits,
            HAS_ZEROS=w.zeros is not None,
            PRECISION=dot_precision(x.dtype),
            EMULATE_BF16=interpret and x.dtype == torch.bfloat16,
            BLOCK_M=tile.block_m,
            BLOCK_N=tile.block_n,
            BLOCK_K=tile.block_k,
        ),
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
        maxnreg=tile.maxnreg,
    )


def quant_matmul(x: Tensor, w: QuantWeight, *, splits: int | None = None) -> Tensor:
    """``x [..., K] @ dequant(w).T`` -> ``[..., N]`` in x's dtype (the
    layout: this module's docstring). ``splits``: split-K programs per
    output tile (default: :func:`split_k` for this GPU; 1 in the interpreter)."""
    check_runnable(_quant_matmul_kernel, x, w.qweight, w.scales)
    n, k = w.scales.shape[0], x.shape[-1]
    if x.dtype not in ACT_DTYPES:
        raise ValueError(f"activations must be one of {ACT_DTYPES}, got {x.dtype}")
    if w.qweight.shape[0] != n or w.in_features != k or w.scales.shape[1] != ceil_div(k, w.group_size):
        raise ValueError(
            f"x has {k} input features but the {w.bits}-bit weight is {tuple(w.qweight.shape)} "
            f"with scales {tuple(w.scales.shape)} (group size {w.group_size}); they must "
            f"describe one [N, K] weight"
        )
    why = supports(w.bits, w.group_size, k)
    if why is not None:
        raise ValueError(f"quant_matmul cannot run {why}; dequantize the weight instead")
    lead = x.shape[:-1]
    flat = x.reshape(-1, k)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    m = flat.shape[0]
    if splits is None:
        tile, splits = variant(m, n, k, w.group_size, x.device)
    else:
        tile = tile_for(m, w.group_size, k)
    interpret = interpreted(_quant_matmul_kernel)
    if splits == 1:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    else:
        out = torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    plan = plan_quant_matmul(flat, w, out, splits, tile, interpret)
    if m:
        plan.run()
    if out.dim() == 3:  # the partials of the splits the plan kept
        out = out[: plan.grid[2]].sum(0).to(x.dtype)
    return out.reshape(*lead, n)


def variant(
    m: int, n: int, k: int, group_size: int, device: torch.device
) -> tuple[QuantTile, int]:
    """The tile and split-K width :func:`quant_matmul` runs ``m`` rows of x
    with on ``device``, for an ``[n, k]`` weight in groups of ``group_size``."""
    return _variant(_bucket(m), group_size, n, k, _sm_count(device))


@functools.cache
def _variant(rows: int, group_size: int, n: int, k: int, sms: int | None) -> tuple[QuantTile, int]:
    """Tile and split for a layer and a row bucket, worked out once: the
    wrapper runs per layer per step, eagerly outside CUDA graphs."""
    tile = tile_for(rows, group_size, k)
    return tile, split_k(tile, rows, n, k, sms)


def _sm_count(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_sms(index)


@functools.cache
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count
