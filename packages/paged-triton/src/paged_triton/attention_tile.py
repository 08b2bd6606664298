"""Device functions shared by the decode and prefill kernels.

Both kernels walk a sequence's context in tiles of ``BLOCK_N`` token
positions, find each token's physical block through the page table, and fold
the tile into an online (streaming) softmax. Keeping those steps here means
the two kernels cannot disagree on masking, soft-capping or the float32
softmax.
"""

from __future__ import annotations

import triton
import triton.language as tl

from paged_triton.interpreter_bf16 import cast, dot


@triton.jit
def attend_context(
    q_rows,
    row_mask,
    pos,
    K,
    V,
    K_SCALE,
    V_SCALE,
    bt_row,
    kv_head,
    kv_off,
    start,
    end,
    full_start,
    full_end,
    window,
    stride_block,
    stride_tok,
    stride_sb,
    stride_st,
    scale,
    softcap,
    ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    PRECISION: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
    KV_QUANT: tl.constexpr,
    HEAD_SCALES: tl.constexpr,
):
    """Attention of ``ROWS`` query rows (``q_rows``: each row's pointer into
    Q, ``row_mask``: the real ones) over the context positions ``start ..
    end`` of one sequence and KV head (``bt_row``: its page-table row,
    ``kv_off``: the head's element offset). ``CAUSAL`` (prefill): row ``i``
    also sees only keys at or before ``pos[i]`` and, with ``USE_WINDOW``,
    after ``pos[i] - window``; decode instead passes a ``start`` that already
    leaves out what its one query cannot see. With ``CAUSAL``, the keys
    ``full_start .. full_end`` (whole ``BLOCK_N`` tiles, ``start <= full_start
    <= full_end <= end``) are ones every row sees: those tiles run without
    any mask (FlashAttention's off-diagonal blocks), the keys before them
    (window only) and after them (the diagonal) with the masks. Returns the
    normalised output ``[ROWS, BLOCK_D]`` (zeros for a row that saw no key)
    with the running max (log2 units) and sum the split decode needs for its
    log-sum-exp. (8-bit caches with ``USE_WINDOW`` mask every tile.)"""
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    q = tl.load(q_rows[:, None] + d[None, :], mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    if KV_QUANT == 0:  # 8-bit caches are dequantized to q's dtype instead
        q = cast(q, K.dtype.element_ty, EMULATE_BF16)
    m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
    # An 8-bit cache's windowed prefill stays one masked loop: its three loops spilled 8 B
    # on sm_80 (Phi-3, static int8 scales, compile matrix).
    SPLIT: tl.constexpr = CAUSAL and (KV_QUANT == 0 or not USE_WINDOW)
    if SPLIT:
        if USE_WINDOW:  # keys some rows' windows have already left
            for t0 in range(start, full_start, BLOCK_N):
                m_i, l_i, acc = _masked_tile(
                    q, m_i, l_i, acc, row_mask, pos, K, V, K_SCALE, V_SCALE, bt_row, kv_head,
                    kv_off, t0, full_start, window, d, d_mask, stride_block, stride_tok,
                    stride_sb, stride_st, scale, softcap, HEAD_DIM, BLOCK_SIZE, BLOCK_N, True,
                    USE_WINDOW, USE_SOFTCAP, PRECISION, EMULATE_BF16, KV_QUANT, HEAD_SCALES,
                )  # fmt: skip
        for t0 in range(full_start, full_end, BLOCK_N):  # seen by every row: no mask
            t0 = tl.multiple_of(t0, BLOCK_N)
            _, _, k, v = load_kv_tile(
                K, V, K_SCALE, V_SCALE, bt_row, kv_head, kv_off, t0, full_end, d, d_mask,
                stride_block, stride_tok, stride_sb, stride_st, BLOCK_SIZE, BLOCK_N, KV_QUANT,
                q.dtype, EMULATE_BF16, HEAD_SCALES, HEAD_DIM, False,
            )  # fmt: skip
            m_i, l_i, acc = attend_tile(
                q, k, v, None, m_i, l_i, acc, scale, softcap, USE_SOFTCAP, PRECISION,
                EMULATE_BF16, False,
            )  # fmt: skip
        start = full_end  # the diagonal: keys only some rows see
    for t0 in range(start, end, BLOCK_N):
        m_i, l_i, acc = _masked_tile(
            q, m_i, l_i, acc, row_mask, pos, K, V, K_SCALE, V_SCALE, bt_row, kv_head, kv_off, t0,
            end, window, d, d_mask, stride_block, stride_tok, stride_sb, stride_st, scale,
            softcap, HEAD_DIM, BLOCK_SIZE, BLOCK_N, CAUSAL, USE_WINDOW, USE_SOFTCAP, PRECISION,
            EMULATE_BF16, KV_QUANT, HEAD_SCALES,
        )  # fmt: skip
    return acc / tl.where(l_i > 0, l_i, 1.0)[:, None], m_i, l_i


@triton.jit
def _masked_tile(
    q,
    m_i,
    l_i,
    acc,
    row_mask,
    pos,
    K,
    V,
    K_SCALE,
    V_SCALE,
    bt_row,
    kv_head,
    kv_off,
    t0,
    end,
    window,
    d,
    d_mask,
    stride_block,
    stride_tok,
    stride_sb,
    stride_st,
    scale,
    softcap,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    PRECISION: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
    KV_QUANT: tl.constexpr,
    HEAD_SCALES: tl.constexpr,
):
    """Fold the tile of keys ``t0 .. t0 + BLOCK_N`` (those before ``end``)
    into the rows' state, each row seeing only the keys its position (and
    window) allows when ``CAUSAL``."""
    tok, tok_mask, k, v = load_kv_tile(
        K, V, K_SCALE, V_SCALE, bt_row, kv_head, kv_off, t0, end, d, d_mask, stride_block,
        stride_tok, stride_sb, stride_st, BLOCK_SIZE, BLOCK_N, KV_QUANT, q.dtype, EMULATE_BF16,
        HEAD_SCALES, HEAD_DIM, True,
    )  # fmt: skip
    visible = row_mask[:, None] & tok_mask[None, :]
    if CAUSAL:
        visible = visible & (tok[None, :] <= pos[:, None])
        if USE_WINDOW:
            visible = visible & (tok[None, :] > pos[:, None] - window)
    return attend_tile(
        q, k, v, visible, m_i, l_i, acc, scale, softcap, USE_SOFTCAP, PRECISION, EMULATE_BF16, True
    )


@triton.jit
def load_kv_tile(
    K,
    V,
    K_SCALE,
    V_SCALE,
    bt_row,
    kv_head,
    kv_off,
    t0,
    end,
    d,
    d_mask,
    stride_block,
    stride_tok,
    stride_sb,
    stride_st,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    KV_QUANT: tl.constexpr,
    COMPUTE: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
    HEAD_SCALES: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    MASKED: tl.constexpr,
):
    """Token positions ``t0 .. t0 + BLOCK_N`` of one KV head (element offset
    ``kv_off``) in caches of shape ``[num_blocks, block_size, kv_heads,
    head_dim]``: block id from the page table row, then the slot inside the
    block. Returns the positions, their mask (``< end``) and the K and V
    tiles ``[BLOCK_N, BLOCK_D]``, zeros where masked. An 8-bit cache
    (``KV_QUANT`` 1: fp8, 2: int8 with float16 scales ``[num_blocks,
    block_size, kv_heads]``) is dequantized here, in registers, to ``COMPUTE``
    (the query's dtype): no dequantized copy of the cache exists. With
    ``HEAD_SCALES`` (int8 or fp8 with static scales) ``K_SCALE``/``V_SCALE``
    hold one float32 per kv head and every code is multiplied by its head's.
    ``KV_QUANT`` 3 (int4, ``paged_ref.kv_int4``): the strides are the packed
    codes', ``stride_sb``/``stride_st`` the K and V scales' block strides.
    ``MASKED`` False: the caller knows the whole tile is before ``end``, so
    no load is masked by position (only by ``HEAD_DIM``, if it is padded)."""
    tok = t0 + tl.arange(0, BLOCK_N)
    tok_mask = tok < end
    if MASKED:
        block = tl.load(bt_row + tok // BLOCK_SIZE, mask=tok_mask, other=0).to(tl.int64)
        kv_mask = tok_mask[:, None] & d_mask[None, :]
    else:
        block = tl.load(bt_row + tok // BLOCK_SIZE).to(tl.int64)
        kv_mask = d_mask[None, :]  # (broadcast by the loads)
    slot_in_block = (tok % BLOCK_SIZE).to(tl.int64)
    rows = block * stride_block + slot_in_block * stride_tok + kv_off
    if KV_QUANT == 3:
        k, v = load_int4_tile(
            K, V, K_SCALE, V_SCALE, block, slot_in_block, rows, kv_head, kv_mask, d, stride_tok,
            stride_sb, stride_st, BLOCK_SIZE, HEAD_DIM,
        )  # fmt: skip
        k = cast(k, COMPUTE, EMULATE_BF16)
        v = cast(v, COMPUTE, EMULATE_BF16)
    else:  # the model's dtype, or 8-bit codes dequantized with their scales
        k = tl.load(K + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(V + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if HEAD_SCALES:
            k_scale = tl.load(K_SCALE + kv_head)
            v_scale = tl.load(V_SCALE + kv_head)
            k = cast(k.to(tl.float32) * k_scale, COMPUTE, EMULATE_BF16)
            v = cast(v.to(tl.float32) * v_scale, COMPUTE, EMULATE_BF16)
        elif KV_QUANT == 2:
            scale_rows = block * stride_sb + slot_in_block * stride_st + kv_head
            k_scale = tl.load(K_SCALE + scale_rows, mask=tok_mask, other=0.0).to(tl.float32)
            v_scale = tl.load(V_SCALE + scale_rows, mask=tok_mask, other=0.0).to(tl.float32)
            k = cast(k.to(tl.float32) * k_scale[:, None], COMPUTE, EMULATE_BF16)
            v = cast(v.to(tl.float32) * v_scale[:, None], COMPUTE, EMULATE_BF16)
        elif KV_QUANT == 1:
            k = cast(k.to(tl.float32), COMPUTE, EMULATE_BF16)
            v = cast(v.to(tl.float32), COMPUTE, EMULATE_BF16)
    return tok, tok_mask, k, v


@triton.jit
def load_int4_tile(
    K,
    V,
    K_SCALE,
    V_SCALE,
    block,
    slot_in_block,
    rows,
    kv_head,
    kv_mask,
    d,
    stride_tok,
    stride_ksb,
    stride_vsb,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    """float32 K and V tiles ``[BLOCK_N, BLOCK_D]`` of a packed int4 cache:
    channel ``d`` is the low (even ``d``) or high nibble of byte ``d // 2``;
    a key reads its group's per-channel ``(scale, min)`` (``k_scales
    [blocks, groups, kv_heads, 2, head_dim]``), a value its own per-channel-
    group pair (``v_scales [blocks, block_size, kv_heads, 2, groups]``)."""
    KEY_GROUP: tl.constexpr = BLOCK_SIZE if BLOCK_SIZE < 64 else 64
    V_GROUP: tl.constexpr = HEAD_DIM if HEAD_DIM < 64 else 64
    NGV: tl.constexpr = HEAD_DIM // V_GROUP
    two_heads = (4 * stride_tok) // HEAD_DIM  # 2 * kv_heads: the codes are contiguous
    shift = ((d % 2) * 4)[None, :]
    k_byte = tl.load(K + rows[:, None] + (d // 2)[None, :], mask=kv_mask, other=0)
    v_byte = tl.load(V + rows[:, None] + (d // 2)[None, :], mask=kv_mask, other=0)
    k_code = ((k_byte >> shift) & 0xF).to(tl.float32)
    v_code = ((v_byte >> shift) & 0xF).to(tl.float32)
    group = slot_in_block // KEY_GROUP
    k_row = block * stride_ksb + (group * two_heads + 2 * kv_head) * HEAD_DIM
    k_at = K_SCALE + k_row[:, None] + d[None, :]
    k_scale = tl.load(k_at, mask=kv_mask, other=0.0).to(tl.float32)
    k_min = tl.load(k_at + HEAD_DIM, mask=kv_mask, other=0.0).to(tl.float32)
    v_row = block * stride_vsb + (slot_in_block * two_heads + 2 * kv_head) * NGV
    v_at = V_SCALE + v_row[:, None] + (d // V_GROUP)[None, :]
    v_scale = tl.load(v_at, mask=kv_mask, other=0.0).to(tl.float32)
    v_min = tl.load(v_at + NGV, mask=kv_mask, other=0.0).to(tl.float32)
    return k_code * k_scale + k_min, v_code * v_scale + v_min


@triton.jit
def soft_cap(s, softcap):
    """``softcap * tanh(s / softcap)``; tanh from exp so it runs the same on
    CUDA and in the interpreter (no libdevice)."""
    x = s / softcap
    t = tl.exp(-2.0 * tl.abs(x))
    th = (1.0 - t) / (1.0 + t)
    return softcap * tl.where(x >= 0, th, -th)


@triton.jit
def attend_tile(
    q,
    k,
    v,
    visible,
    m_i,
    l_i,
    acc,
    scale,
    softcap,
    USE_SOFTCAP: tl.constexpr,
    PRECISION: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
    MASKED: tl.constexpr,
):
    """Fold one K/V tile into the running softmax state of every query row.

    ``q``: [M, D]; ``k``/``v``: [N, D] (cache dtype); ``visible``: [M, N];
    ``m_i`` (running max, log2 units), ``l_i`` (running sum), ``acc``
    ([M, D]) in float32. Scores are scaled, soft-capped, then masked, as the
    contract says (``MASKED`` False: every key is visible, ``visible`` unused). A row that has seen no visible key keeps ``m = -inf``;
    its exponent base is taken as 0 so nothing becomes NaN.
    ``EMULATE_BF16``: see interpreter_bf16.py (True only when interpreting bf16).
    """
    s = dot(q, tl.trans(k), PRECISION, EMULATE_BF16) * scale
    if USE_SOFTCAP:
        s = soft_cap(s, softcap)
    # log2 units from here on (1.44... = log2(e)): exp2 is the fast exponential.
    s = s * 1.4426950408889634
    if MASKED:
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_base = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_base)
    p = tl.exp2(s - m_base[:, None])
    l_new = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + dot(cast(p, v.dtype, EMULATE_BF16), v, PRECISION, EMULATE_BF16)
    return m_new, l_new, acc
