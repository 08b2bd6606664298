"""Scatter the new tokens' K/V into their cache slots.

One program per token writes all kv heads of that token for K and V; the
slot mapping (``block_id * block_size + offset``) says where, and slot ``-1``
(padding in a right-padded batch) writes nothing. An 8-bit cache is
quantized here, in registers (``paged_ref.kv_quant`` says how): int8 takes
each head's absmax over ``head_dim`` (the program holds the whole row) and
writes the float16 scale beside the codes; fp8 is a saturating cast. With
static per-head scales (``HEAD_SCALES``, from ``calculate_kv_scales``) both
store ``value / scale``, rounded and clamped (int8) or cast saturating (fp8),
and write no scale.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Any

import torch
import triton
import triton.language as tl

from paged_ref.kv_int4 import is_int4
from paged_ref.kv_quant import FP8_MAX, logical_shape
from paged_ref.op_args import WriteKVArgs, op
from paged_triton.interpreter_bf16 import cast, round_to_fp8
from paged_triton.launch import Launch
from paged_triton.launch_checks import (
    as_index,
    check_cache,
    check_quantized_cache,
    check_runnable,
    interpreted,
    kv_quant_mode,
    last_dim_contiguous,
    scale_args,
)
from paged_triton.write_kv_int4 import plan_write_kv_int4

# fp8 formats: mantissa bits and the exponent of the smallest normal number.
FP8_FORMATS = {torch.float8_e4m3fn: (3, -6), torch.float8_e5m2: (2, -14)}


# The slot mapping is a view into the step's packed metadata (8-byte aligned).
@triton.jit(do_not_specialize_on_alignment=["SLOTS"])
def _write_kv_kernel(
    K_NEW,
    V_NEW,
    K_CACHE,
    V_CACHE,
    SLOTS,
    K_SCALE,
    V_SCALE,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_ch,
    stride_ct,
    stride_sb,
    stride_st,
    KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_KVH: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
    KV_QUANT: tl.constexpr,
    FP8_MAX: tl.constexpr,
    FP8_MANTISSA: tl.constexpr,
    FP8_MIN_EXP: tl.constexpr,
    EMULATE_FP8: tl.constexpr,
    HEAD_SCALES: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(SLOTS + t)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    h = tl.arange(0, BLOCK_KVH)
    d = tl.arange(0, BLOCK_D)
    mask = (h < KV_HEADS)[:, None] & (d < HEAD_DIM)[None, :]
    dst = block * stride_cb + h[:, None] * stride_ch + offset * stride_ct + d[None, :]
    scale_dst = block * stride_sb + offset * stride_st + h
    k = tl.load(K_NEW + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask, other=0.0)
    _store_row(K_CACHE, K_SCALE, dst, scale_dst, k, mask, h < KV_HEADS, KV_QUANT, FP8_MAX,
               FP8_MANTISSA, FP8_MIN_EXP, EMULATE_FP8, EMULATE_BF16, HEAD_SCALES)  # fmt: skip
    v = tl.load(V_NEW + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask, other=0.0)
    _store_row(V_CACHE, V_SCALE, dst, scale_dst, v, mask, h < KV_HEADS, KV_QUANT, FP8_MAX,
               FP8_MANTISSA, FP8_MIN_EXP, EMULATE_FP8, EMULATE_BF16, HEAD_SCALES)  # fmt: skip


@triton.jit
def _store_row(
    CACHE,
    SCALE,
    dst,
    scale_dst,
    x,
    mask,
    head_mask,
    KV_QUANT: tl.constexpr,
    FP8_MAX: tl.constexpr,
    FP8_MANTISSA: tl.constexpr,
    FP8_MIN_EXP: tl.constexpr,
    EMULATE_FP8: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
    HEAD_SCALES: tl.constexpr,
):
    """Store one token's ``[heads, head_dim]`` row as the cache stores it.
    ``KV_QUANT``: 0 the cache's own dtype, 1 fp8 (saturating cast), 2 int8
    with one scale per head. ``HEAD_SCALES``: divide by the static per-head
    scales at ``SCALE`` (``scale_dst`` is then the head index) instead.
    Divisions round to nearest (``div_rn``), as torch's do, so both backends
    pick the same codes."""
    if HEAD_SCALES:
        s = tl.load(SCALE + scale_dst, mask=head_mask, other=1.0)
        y = tl.math.div_rn(x.to(tl.float32), s[:, None])
        if KV_QUANT == 2:
            codes = tl.where(y >= 0, tl.floor(y + 0.5), -tl.floor(0.5 - y))  # ties away from 0
            codes = tl.minimum(tl.maximum(codes, -127.0), 127.0)
            tl.store(CACHE + dst, codes.to(tl.int8), mask=mask)
        else:
            y = tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX)
            if EMULATE_FP8:
                y = round_to_fp8(y, FP8_MANTISSA, FP8_MIN_EXP)
            tl.store(CACHE + dst, y.to(CACHE.dtype.element_ty), mask=mask)
    elif KV_QUANT == 2:
        x = x.to(tl.float32)
        scale = tl.math.div_rn(tl.max(tl.abs(x), 1), 127.0).to(tl.float16)
        s = scale.to(tl.float32)
        y = tl.math.div_rn(x, tl.where(s > 0, s, 1.0)[:, None])
        y = tl.where(s[:, None] > 0, y, 0.0)
        codes = tl.where(y >= 0, tl.floor(y + 0.5), -tl.floor(0.5 - y))  # ties away from 0
        codes = tl.minimum(tl.maximum(codes, -127.0), 127.0)
        tl.store(CACHE + dst, codes.to(tl.int8), mask=mask)
        tl.store(SCALE + scale_dst, scale, mask=head_mask)
    elif KV_QUANT == 1:
        x = tl.minimum(tl.maximum(x.to(tl.float32), -FP8_MAX), FP8_MAX)
        if EMULATE_FP8:  # the interpreter's own cast rounds wrongly (interpreter_bf16.py)
            x = round_to_fp8(x, FP8_MANTISSA, FP8_MIN_EXP)
        tl.store(CACHE + dst, x.to(CACHE.dtype.element_ty), mask=mask)
    else:
        tl.store(CACHE + dst, cast(x, CACHE.dtype.element_ty, EMULATE_BF16), mask=mask)


@functools.lru_cache(maxsize=64)
def _constexprs(
    kv_heads: int,
    head_dim: int,
    block_size: int,
    emulate_bf16: bool,
    cache_dtype: torch.dtype,
    interpret: bool = False,
    head_scales: bool = False,
) -> dict[str, Any]:
    mantissa, min_exp = FP8_FORMATS.get(cache_dtype, (0, 0))
    return dict(
        KV_HEADS=kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_KVH=triton.next_power_of_2(kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size,
        EMULATE_BF16=emulate_bf16,
        KV_QUANT=kv_quant_mode(cache_dtype),
        FP8_MAX=FP8_MAX.get(cache_dtype, 0.0),
        FP8_MANTISSA=mantissa,
        FP8_MIN_EXP=min_exp,
        EMULATE_FP8=interpret and cache_dtype in FP8_FORMATS,
        HEAD_SCALES=head_scales,
    )


def plan_write_kv(a: WriteKVArgs, interpret: bool = False) -> Launch:
    """One program per token; ``a.slot_mapping`` is int64 on the cache's
    device; ``k_scales``/``v_scales`` (int8 only) ``[num_blocks, block_size,
    kv_heads]``, or static ``k_head_scales``/``v_head_scales`` ``[kv_heads]``.
    An int4 cache gets its own kernel (``write_kv_int4``)."""
    k_cache, v_cache, k, v, slots = a.k_cache, a.v_cache, a.k, a.v, a.slot_mapping
    if is_int4(k_cache.dtype):
        return plan_write_kv_int4(k_cache, v_cache, k, v, slots, a.k_scales, a.v_scales)  # type: ignore[arg-type]
    _, block_size, kv_heads, head_dim = k_cache.shape
    ks, vs, cs = k.stride(), v.stride(), k_cache.stride()
    k_scale, v_scale, ss = scale_args(
        k_cache, v_cache, a.k_scales, a.v_scales, a.k_head_scales, a.v_head_scales
    )
    return Launch(
        _write_kv_kernel,
        (k.shape[0],),
        (
            k,
            v,
            k_cache,
            v_cache,
            slots,
            k_scale,
            v_scale,
            ks[0],
            ks[1],
            vs[0],
            vs[1],
            cs[0],  # block
            cs[2],  # kv head
            cs[1],  # token within the block
            ss[0],  # scales: block
            ss[1],  # scales: token within the block
        ),
        _constexprs(
            kv_heads, head_dim, block_size,
            interpret and torch.bfloat16 in (k_cache.dtype, k.dtype), k_cache.dtype, interpret,
            a.k_head_scales is not None,
        ),  # fmt: skip
        num_warps=4,
        num_stages=1,
    )


@op(WriteKVArgs)
def write_kv(a: WriteKVArgs) -> None:
    """Write ``k``/``v`` (``[num_tokens, kv_heads, head_dim]``, any dtype,
    e.g. views into a fused QKV output) into the cache at
    ``slot_mapping[i] = block_id * block_size + offset``; slot ``-1`` is skipped.
    An 8-bit cache gets codes (int8: and scales in ``k_scales``/``v_scales``;
    with static ``k_head_scales``/``v_head_scales``, codes of value / scale).
    Same contract as ``paged_ref.ops.write_kv``.
    """
    k_cache, v_cache, k, v = a.k_cache, a.v_cache, a.k, a.v
    check_runnable(_write_kv_kernel, k_cache, v_cache, k, v)
    check_cache(k_cache, v_cache)
    check_quantized_cache(k_cache, a.k_scales, a.v_scales, a.k_head_scales, a.v_head_scales)
    _, _, kv_heads, head_dim = logical_shape(k_cache)
    expected = (a.slot_mapping.shape[0], kv_heads, head_dim)
    if k.shape != expected or v.shape != expected:
        raise ValueError(
            f"k and v must be [num_tokens, kv_heads, head_dim] = {expected} to match slot_mapping "
            f"and the cache; got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    if k.shape[0] == 0:
        return
    if is_int4(k_cache.dtype) and k_cache.stride(1) != kv_heads * head_dim // 2:
        raise ValueError(f"an int4 cache needs contiguous blocks, got strides {k_cache.stride()}")
    slots = as_index(a.slot_mapping, k_cache, torch.int64)
    kernel_args = replace(a, k=last_dim_contiguous(k), v=last_dim_contiguous(v), slot_mapping=slots)
    plan_write_kv(kernel_args, _INTERPRETED).run()


_INTERPRETED = interpreted(_write_kv_kernel)
