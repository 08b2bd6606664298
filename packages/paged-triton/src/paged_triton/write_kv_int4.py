"""Write new tokens into a packed int4 cache (``paged_ref.kv_int4`` says what it stores).

One program per new token. It quantizes the token's values on its own
(per token, one ``(scale, min)`` per group of channels), then, if it is the
last new token of its key group in this batch, re-quantizes that group's
keys: the group's written codes are read back, the batch's new keys of the
group put beside them, and every channel's range taken again. Programs of
the same group other than the last write no keys, so no two programs
write one group. Which earlier rows of the batch are new tokens of the same
group is read from the slot mapping itself (a sequence's tokens sit in
consecutive rows with consecutive slots), so nothing is computed on the host.
"""

from __future__ import annotations

import functools
from typing import Any

import triton
import triton.language as tl
from torch import Tensor

from paged_ref.kv_int4 import key_group, value_group
from paged_triton.launch import Launch


@triton.jit
def _quantize(x, s, m):
    """Codes 0..15 of ``x`` for float32 ``s``/``m`` (as ``kv_int4.quantize_with``)."""
    y = tl.where(s > 0, tl.math.div_rn(x - m, tl.where(s > 0, s, 1.0)), 0.0)
    q = tl.where(y >= 0, tl.floor(y + 0.5), -tl.floor(0.5 - y))  # ties away from 0
    return tl.minimum(tl.maximum(q, 0.0), 15.0)


@triton.jit(do_not_specialize=["num_tokens"], do_not_specialize_on_alignment=["SLOTS"])
def _write_kv_int4_kernel(
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
    stride_ksb,
    stride_vsb,
    num_tokens,
    KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_KVH: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    KEY_GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    V_GROUP: tl.constexpr,
):
    HALF: tl.constexpr = HEAD_DIM // 2
    NGV: tl.constexpr = HEAD_DIM // V_GROUP
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(SLOTS + t)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    row_stride = KV_HEADS * HALF  # bytes per token

    # Values: this token alone, all heads, each group of V_GROUP channels.
    h = tl.arange(0, BLOCK_KVH)
    g = tl.arange(0, NGV)
    i = tl.arange(0, V_GROUP // 2)
    h_ok = (h < KV_HEADS)[:, None, None]
    even = (g * V_GROUP)[None, :, None] + (2 * i)[None, None, :]
    src = V_NEW + t * stride_vt + h[:, None, None] * stride_vh + even
    x_e = tl.load(src, mask=h_ok, other=0.0).to(tl.float32)
    x_o = tl.load(src + 1, mask=h_ok, other=0.0).to(tl.float32)
    lo = tl.minimum(tl.min(x_e, 2), tl.min(x_o, 2))
    hi = tl.maximum(tl.max(x_e, 2), tl.max(x_o, 2))
    scale = tl.math.div_rn(hi - lo, 15.0).to(tl.float16)
    m16 = lo.to(tl.float16)
    s = scale.to(tl.float32)[:, :, None]
    m = m16.to(tl.float32)[:, :, None]
    packed = _quantize(x_e, s, m).to(tl.uint8) | (_quantize(x_o, s, m).to(tl.uint8) << 4)
    dst = block * stride_cb + off * row_stride + h[:, None, None] * HALF + even // 2
    tl.store(V_CACHE + dst, packed, mask=h_ok)
    v_at = V_SCALE + block * stride_vsb + (off * KV_HEADS + h[:, None]) * (2 * NGV) + g[None, :]
    tl.store(v_at, scale, mask=(h < KV_HEADS)[:, None])
    tl.store(v_at + NGV, m16, mask=(h < KV_HEADS)[:, None])

    # Keys: only the batch's last new token of a group re-quantizes it.
    gin = off % KEY_GROUP
    start = off - gin  # the group's first offset in the block
    nxt = tl.load(SLOTS + t + 1, mask=t + 1 < num_tokens, other=-1)
    if (nxt == slot + 1) & (gin + 1 < KEY_GROUP) & (off + 1 < BLOCK_SIZE):
        return
    j = tl.arange(0, BLOCK_G)
    inside = (j < KEY_GROUP) & (start + j < BLOCK_SIZE)
    written = inside & (j <= gin)
    back = gin - j  # how many rows before t the token at offset start + j would sit
    src_t = t - back
    src_ok = written & (src_t >= 0)
    src_slot = tl.load(SLOTS + src_t, mask=src_ok, other=-1)
    new = src_ok & (src_slot == slot - back)
    c = tl.arange(0, HALF)
    rows = block * stride_cb + (start + j) * row_stride
    old_mask = (written & (new == 0))[:, None]
    new_mask = new[:, None]
    for kh in range(KV_HEADS):
        at = K_CACHE + rows[:, None] + kh * HALF + c[None, :]
        byte = tl.load(at, mask=old_mask, other=0)
        k_at = K_SCALE + block * stride_ksb + ((start // KEY_GROUP) * KV_HEADS + kh) * (2 * HEAD_DIM)
        s_e = tl.load(k_at + 2 * c).to(tl.float32)[None, :]
        s_o = tl.load(k_at + 2 * c + 1).to(tl.float32)[None, :]
        m_e = tl.load(k_at + HEAD_DIM + 2 * c).to(tl.float32)[None, :]
        m_o = tl.load(k_at + HEAD_DIM + 2 * c + 1).to(tl.float32)[None, :]
        k_src = K_NEW + src_t[:, None] * stride_kt + kh * stride_kh + 2 * c[None, :]
        new_e = tl.load(k_src, mask=new_mask, other=0.0).to(tl.float32)
        new_o = tl.load(k_src + 1, mask=new_mask, other=0.0).to(tl.float32)
        kx_e = tl.where(new_mask, new_e, (byte & 0xF).to(tl.float32) * s_e + m_e)
        kx_o = tl.where(new_mask, new_o, (byte >> 4).to(tl.float32) * s_o + m_o)
        w = written[:, None]
        lo_e = tl.min(tl.where(w, kx_e, float("inf")), 0)
        hi_e = tl.max(tl.where(w, kx_e, float("-inf")), 0)
        lo_o = tl.min(tl.where(w, kx_o, float("inf")), 0)
        hi_o = tl.max(tl.where(w, kx_o, float("-inf")), 0)
        sc_e = tl.math.div_rn(hi_e - lo_e, 15.0).to(tl.float16)
        sc_o = tl.math.div_rn(hi_o - lo_o, 15.0).to(tl.float16)
        mn_e = lo_e.to(tl.float16)
        mn_o = lo_o.to(tl.float16)
        q_e = _quantize(kx_e, sc_e.to(tl.float32)[None, :], mn_e.to(tl.float32)[None, :])
        q_o = _quantize(kx_o, sc_o.to(tl.float32)[None, :], mn_o.to(tl.float32)[None, :])
        kpacked = tl.where(w, q_e, 0.0).to(tl.uint8) | (tl.where(w, q_o, 0.0).to(tl.uint8) << 4)
        tl.store(at, kpacked, mask=inside[:, None])
        tl.store(k_at + 2 * c, sc_e)
        tl.store(k_at + 2 * c + 1, sc_o)
        tl.store(k_at + HEAD_DIM + 2 * c, mn_e)
        tl.store(k_at + HEAD_DIM + 2 * c + 1, mn_o)


@functools.lru_cache(maxsize=64)
def _constexprs(kv_heads: int, head_dim: int, block_size: int) -> dict[str, Any]:
    group = key_group(block_size)
    return dict(
        KV_HEADS=kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_KVH=triton.next_power_of_2(kv_heads),
        BLOCK_SIZE=block_size,
        KEY_GROUP=group,
        BLOCK_G=triton.next_power_of_2(group),
        V_GROUP=value_group(head_dim),
    )


def plan_write_kv_int4(
    k_cache: Tensor,
    v_cache: Tensor,
    k: Tensor,
    v: Tensor,
    slots: Tensor,
    k_scales: Tensor,
    v_scales: Tensor,
) -> Launch:
    """One program per token; ``slots`` int64 on the cache's device; the
    caches packed ``[num_blocks, block_size, kv_heads, head_dim // 2]`` uint8
    with contiguous blocks, the scales as ``kv_int4.new_int4_scales`` makes them."""
    _, block_size, kv_heads, half = k_cache.shape
    head_dim = 2 * half
    if head_dim & (head_dim - 1):
        raise ValueError(f"the Triton int4 kernels need a power-of-two head_dim, got {head_dim}")
    ks, vs = k.stride(), v.stride()
    return Launch(
        _write_kv_int4_kernel,
        (k.shape[0],),
        (
            k,
            v,
            k_cache,
            v_cache,
            slots,
            k_scales,
            v_scales,
            ks[0],
            ks[1],
            vs[0],
            vs[1],
            k_cache.stride(0),
            k_scales.stride(0),
            v_scales.stride(0),
            k.shape[0],
        ),
        _constexprs(kv_heads, head_dim, block_size),
        num_warps=4,
        num_stages=1,
    )
