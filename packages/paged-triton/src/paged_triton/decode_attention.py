"""Paged decode attention: one query token per sequence, K/V read in place.

One program serves a (sequence, kv head) pair and *all* query heads of that
kv head's group, so each K/V tile is loaded once per group (GQA/MQA). The
group is padded to 16 rows so the scores and the weighted sum are ``tl.dot``
tensor-core products. Tokens are fetched through the page table per
position, so any block size works and a tile may span several blocks.

For small batches with long contexts (too few programs to fill the GPU) the
context is split across programs (flash-decoding): each split writes a
partial, normalised output and its log-sum-exp, and a second kernel merges
them (decode_splits.py). ``choose_num_splits`` decides from shapes the
host already knows, so no device sync happens per step.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from paged_triton.attention_tile import attend_tile, load_kv_tile
from paged_triton.decode_splits import choose_num_splits, merge_splits, num_sms
from paged_triton.launch_checks import (
    as_int32,
    check_cache,
    check_gqa,
    check_runnable,
    dot_precision,
    last_dim_contiguous,
)

BLOCK_N = 64  # token positions per tile
MIN_DOT = 16  # tl.dot wants every dimension >= 16
MAX_HEADS_PER_PROGRAM = 64  # larger groups (big MQA) are split over programs


@triton.jit
def _decode_kernel(
    Q,
    K,
    V,
    BT,
    LENS,
    OUT,
    PART_ACC,
    PART_LSE,
    stride_qb,
    stride_qh,
    stride_cb,
    stride_ch,
    stride_ct,
    stride_btb,
    stride_ob,
    stride_oh,
    scale,
    softcap,
    window,
    num_splits,
    num_heads,
    GROUP: tl.constexpr,
    HEADS_PER_PROG: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    SPLIT: tl.constexpr,
    PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    pid_h = tl.program_id(1)
    split = tl.program_id(2)
    head_blocks: tl.constexpr = (GROUP + HEADS_PER_PROG - 1) // HEADS_PER_PROG
    kv_head = pid_h // head_blocks
    first = (pid_h % head_blocks) * HEADS_PER_PROG

    g = tl.arange(0, BLOCK_H)
    head_mask = (g < HEADS_PER_PROG) & (first + g < GROUP)
    heads = kv_head * GROUP + first + g
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    qd_mask = head_mask[:, None] & d_mask[None, :]
    q = tl.load(
        Q + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=qd_mask, other=0.0
    )
    q = q.to(K.dtype.element_ty)

    # Visible keys of the query at position seq_len - 1: [lo, seq_len).
    seq_len = tl.load(LENS + b)
    lo = seq_len * 0
    if USE_WINDOW:
        lo = tl.maximum(seq_len - window, 0)
    start = lo
    end = seq_len
    if SPLIT:
        per_split = tl.cdiv(tl.cdiv(seq_len - lo, num_splits), BLOCK_N) * BLOCK_N
        start = lo + split * per_split
        end = tl.minimum(start + per_split, seq_len)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    bt_row = BT + b.to(tl.int64) * stride_btb
    kv_off = kv_head.to(tl.int64) * stride_ch
    for t0 in range(start, end, BLOCK_N):
        tok, tok_mask, k, v = load_kv_tile(
            K, V, bt_row, kv_off, t0, end, d, d_mask, stride_cb, stride_ct, BLOCK_SIZE, BLOCK_N
        )
        m_i, l_i, acc = attend_tile(
            q, k, v, tok_mask[None, :], m_i, l_i, acc, scale, softcap, USE_SOFTCAP, PRECISION
        )

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # no visible key -> zeros
    if SPLIT:
        # Partial results: [batch, heads, num_splits, BLOCK_D] and [batch, heads, num_splits].
        row = (b * num_heads + heads) * num_splits + split
        tl.store(PART_ACC + row[:, None] * BLOCK_D + d[None, :], out, mask=head_mask[:, None])
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(PART_LSE + row, lse, mask=head_mask)
    else:
        o_ptrs = OUT + b * stride_ob + heads[:, None] * stride_oh + d[None, :]
        tl.store(o_ptrs, out.to(OUT.dtype.element_ty), mask=qd_mask)


def decode_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    num_splits: int | None = None,
) -> Tensor:
    """:func:`paged_decode_attention` with the split count exposed
    (``None``: :func:`choose_num_splits`; tests force the split path)."""
    check_runnable(_decode_kernel, q, k_cache, v_cache)
    check_cache(k_cache, v_cache)
    if q.dim() != 3:
        raise ValueError(f"q must be [batch, heads, head_dim], got shape {tuple(q.shape)}")
    batch, heads, head_dim = q.shape
    _, block_size, kv_heads, cache_dim = k_cache.shape
    if cache_dim != head_dim:
        raise ValueError(f"q head_dim {head_dim} != cache head_dim {cache_dim}")
    group = check_gqa(heads, kv_heads)
    if block_tables.dim() != 2 or block_tables.shape[0] != batch or seq_lens.shape != (batch,):
        raise ValueError(
            f"block_tables must be [batch={batch}, max_blocks] and seq_lens [batch], got "
            f"{tuple(block_tables.shape)} and {tuple(seq_lens.shape)}"
        )
    out = torch.empty_like(q)
    if batch == 0 or heads == 0:
        return out
    q = last_dim_contiguous(q)
    tables = as_int32(block_tables, q.device)
    lens = as_int32(seq_lens, q.device)

    heads_per_prog = min(group, MAX_HEADS_PER_PROGRAM)
    head_programs = kv_heads * triton.cdiv(group, heads_per_prog)
    block_d = max(MIN_DOT, triton.next_power_of_2(head_dim))
    if num_splits is None:
        max_context = tables.shape[1] * block_size
        if sliding_window is not None:
            max_context = min(max_context, max(sliding_window, 1))
        num_splits = choose_num_splits(batch * head_programs, max_context, num_sms(q.device))
    num_splits = max(1, int(num_splits))
    split = num_splits > 1
    if split:
        part_acc = torch.empty(
            batch, heads, num_splits, block_d, device=q.device, dtype=torch.float32
        )
        part_lse = torch.empty(batch, heads, num_splits, device=q.device, dtype=torch.float32)
    else:
        part_acc = part_lse = out  # unused: the kernel stores straight to `out`

    _decode_kernel[(batch, head_programs, num_splits)](
        q,
        k_cache,
        v_cache,
        tables,
        lens,
        out,
        part_acc,
        part_lse,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(2),  # kv head
        k_cache.stride(1),  # token within the block
        tables.stride(0),
        out.stride(0),
        out.stride(1),
        float(scale),
        float(softcap or 1.0),
        int(sliding_window or 0),
        num_splits,
        heads,
        GROUP=group,
        HEADS_PER_PROG=heads_per_prog,
        BLOCK_H=max(MIN_DOT, triton.next_power_of_2(heads_per_prog)),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_SIZE=block_size,
        BLOCK_N=BLOCK_N,
        USE_WINDOW=sliding_window is not None,
        USE_SOFTCAP=bool(softcap),
        SPLIT=split,
        PRECISION=dot_precision(k_cache.dtype),
        num_warps=4,
    )
    if split:
        merge_splits(part_acc, part_lse, out)
    return out


def paged_decode_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    *,
    memo: dict[Any, Any] | None = None,
) -> Tensor:
    """One query per sequence (``q``: ``[batch, heads, head_dim]``) at position
    ``seq_lens[b] - 1`` over its paged context, read straight from the cache
    blocks (no gather copy). ``seq_lens`` includes the new token; 0 gives
    zeros. Same contract as ``paged_ref.ops.paged_decode_attention``
    (``memo``, the caller's per-step scratch dict, is accepted for parity).
    """
    return decode_attention(
        q, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window, softcap
    )
