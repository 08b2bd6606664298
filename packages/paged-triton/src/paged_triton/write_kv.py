"""Scatter the new tokens' K/V into their cache slots.

One program per token writes all kv heads of that token for K and V; the
slot mapping (``block_id * block_size + offset``) says where, and slot ``-1``
(padding in a right-padded batch) writes nothing.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from paged_triton.interpreter_bf16 import cast
from paged_triton.launch import Launch
from paged_triton.launch_checks import (
    as_int64,
    check_cache,
    check_runnable,
    interpreted,
    last_dim_contiguous,
)


# The slot mapping is a view into the step's packed metadata (8-byte aligned).
@triton.jit(do_not_specialize_on_alignment=["SLOTS"])
def _write_kv_kernel(
    K_NEW,
    V_NEW,
    K_CACHE,
    V_CACHE,
    SLOTS,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_ch,
    stride_ct,
    KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_KVH: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
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
    k = tl.load(K_NEW + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    tl.store(K_CACHE + dst, cast(k, K_CACHE.dtype.element_ty, EMULATE_BF16), mask=mask)
    v = tl.load(V_NEW + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    tl.store(V_CACHE + dst, cast(v, V_CACHE.dtype.element_ty, EMULATE_BF16), mask=mask)


@functools.lru_cache(maxsize=64)
def _constexprs(
    kv_heads: int, head_dim: int, block_size: int, emulate_bf16: bool
) -> dict[str, Any]:
    return dict(
        KV_HEADS=kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_KVH=triton.next_power_of_2(kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size,
        EMULATE_BF16=emulate_bf16,
    )


def plan_write_kv(
    k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, slots: Tensor, interpret: bool = False
) -> Launch:
    """One program per token; ``slots`` is int64 on the cache's device."""
    _, block_size, kv_heads, head_dim = k_cache.shape
    ks, vs, cs = k.stride(), v.stride(), k_cache.stride()
    return Launch(
        _write_kv_kernel,
        (k.shape[0],),
        (
            k,
            v,
            k_cache,
            v_cache,
            slots,
            ks[0],
            ks[1],
            vs[0],
            vs[1],
            cs[0],  # block
            cs[2],  # kv head
            cs[1],  # token within the block
        ),
        _constexprs(kv_heads, head_dim, block_size, interpret and k_cache.dtype == torch.bfloat16),
        num_warps=4,
        num_stages=1,
    )


def write_kv(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, slot_mapping: Tensor) -> None:
    """Write ``k``/``v`` (``[num_tokens, kv_heads, head_dim]``, any dtype,
    e.g. views into a fused QKV output) into the cache at
    ``slot_mapping[i] = block_id * block_size + offset``; slot ``-1`` is skipped.
    Same contract as ``paged_ref.ops.write_kv``.
    """
    check_runnable(_write_kv_kernel, k_cache, v_cache, k, v)
    check_cache(k_cache, v_cache)
    _, _, kv_heads, head_dim = k_cache.shape
    expected = (slot_mapping.shape[0], kv_heads, head_dim)
    if k.shape != expected or v.shape != expected:
        raise ValueError(
            f"k and v must be [num_tokens, kv_heads, head_dim] = {expected} to match slot_mapping "
            f"and the cache; got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    if k.shape[0] == 0:
        return
    k, v = last_dim_contiguous(k), last_dim_contiguous(v)
    slots = as_int64(slot_mapping, k_cache)
    plan_write_kv(k_cache, v_cache, k, v, slots, _INTERPRETED).run()


_INTERPRETED = interpreted(_write_kv_kernel)
