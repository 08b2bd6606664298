"""Paged decode attention: one query token per sequence, K/V read in place.

One program serves a (sequence, kv head) pair and *all* ``Q_PER_KV`` query
heads that share that kv head, so each K/V tile is loaded once for them
(GQA/MQA). They are padded to 16 rows so the scores and the weighted sum are ``tl.dot``
tensor-core products. Tokens are fetched through the page table per
position, so any block size works and a tile may span several blocks.

Long contexts are cut into pieces on the device (flash-decoding with a
per-sequence split, decode_splits.py): the grid has a fixed number of
split programs per sequence, decided from shapes alone, and each program
learns from ``seq_lens`` whether its piece exists. Nothing here syncs with
the host, and the integers that change from step to step (batch, the block
table's width, the split grid) are not specialised by Triton, so a new step
never compiles a new kernel variant.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from paged_ref.op_args import DecodeArgs, op
from paged_triton.attention_layout import check_attention, layer_layout
from paged_triton.attention_tile import attend_context
from paged_triton.decode_splits import (
    SplitPolicy,
    plan_merge,
    split_plan,
    split_policy,
    visible_len,
)
from paged_triton.interpreter_bf16 import cast
from paged_triton.launch import Launch, run_planned
from paged_triton.launch_checks import as_index, interpreted, last_dim_contiguous
from paged_triton.tile_config import TileConfig

# Arguments that change from step to step: never specialised (no mid-serving compiles).
PER_STEP_INTS = [
    "stride_btb",
    "batch",
    "window",
    "min_chunk",
    "target_programs",
    "max_splits",
    "partial_rows",
]
PER_STEP_POINTERS = ["BT", "LENS"]  # views into the step's packed metadata: 8-byte aligned


@triton.jit(do_not_specialize=PER_STEP_INTS, do_not_specialize_on_alignment=PER_STEP_POINTERS)
def _decode_kernel(
    Q,
    K,
    V,
    K_SCALE,
    V_SCALE,
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
    stride_sb,
    stride_st,
    stride_btb,
    stride_ob,
    stride_oh,
    scale,
    softcap,
    num_heads,
    head_programs,
    batch,
    window,
    min_chunk,
    target_programs,
    max_splits,
    partial_rows,
    Q_PER_KV: tl.constexpr,
    HEADS_PER_PROG: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_B: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    PRECISION: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
    KV_QUANT: tl.constexpr,
    HEAD_SCALES: tl.constexpr,
):
    b = tl.program_id(0)
    pid_h = tl.program_id(1)
    split = tl.program_id(2)

    # Visible keys of the query at position seq_len - 1: [seq_len - n, seq_len).
    seq_len = tl.load(LENS + b)
    n = visible_len(seq_len, window, USE_WINDOW)
    # Cheap exit first: no sequence gets more than n // min_chunk pieces, nor more
    # than the grid has (max_splits is 1 when the host knows nothing can split).
    limit = tl.maximum(tl.minimum(n // min_chunk, max_splits), 1)
    if split >= limit:
        return
    pieces = limit * 0 + 1
    row0 = limit * 0
    if limit > 1:
        pieces, row0 = split_plan(
            LENS, b, batch, window, head_programs, min_chunk, target_programs, max_splits,
            USE_WINDOW, BLOCK_B,
        )  # fmt: skip
    if split >= pieces:
        return
    lo = seq_len - n
    start = lo
    end = seq_len
    if pieces > 1:
        # Piece boundaries on tile multiples. A piece holds >= min_chunk keys, so
        # none is empty when min_chunk >= BLOCK_N; an empty one (tests use small
        # pieces) stores lse = -inf and weighs nothing in the merge.
        start = lo + (split * n // pieces) // BLOCK_N * BLOCK_N
        if split + 1 < pieces:
            end = lo + ((split + 1) * n // pieces) // BLOCK_N * BLOCK_N

    head_blocks: tl.constexpr = (Q_PER_KV + HEADS_PER_PROG - 1) // HEADS_PER_PROG
    kv_head = pid_h // head_blocks
    first = (pid_h % head_blocks) * HEADS_PER_PROG
    qh = tl.arange(0, BLOCK_H)  # query head in this program
    head_mask = (qh < HEADS_PER_PROG) & (first + qh < Q_PER_KV)
    heads = kv_head * Q_PER_KV + first + qh
    out, m_i, l_i = attend_context(
        Q + b * stride_qb + heads * stride_qh, head_mask, seq_len, K, V, K_SCALE, V_SCALE,
        BT + b.to(tl.int64) * stride_btb, kv_head, kv_head.to(tl.int64) * stride_ch, start, end,
        start, start, window, stride_cb, stride_ct, stride_sb, stride_st, scale, softcap, BLOCK_H, HEAD_DIM,
        BLOCK_D, BLOCK_SIZE, BLOCK_N, False, USE_WINDOW, USE_SOFTCAP, PRECISION, EMULATE_BF16,
        KV_QUANT, HEAD_SCALES,
    )  # fmt: skip
    d = tl.arange(0, BLOCK_D)
    if pieces > 1:
        # Piece `split` of b: partial rows [partial_rows, num_heads, BLOCK_D] and [.., num_heads].
        row = row0 + split
        part = row * num_heads + heads
        # (The scalar test is broadcast: Triton's interpreter turns `bool tensor &
        # bool scalar` into integers, which a store rejects as a mask.)
        keep = head_mask & (qh * 0 + row < partial_rows)
        tl.store(PART_ACC + part[:, None] * BLOCK_D + d[None, :], out, mask=keep[:, None])
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(PART_LSE + part, lse, mask=keep)
    else:
        o_ptrs = OUT + b * stride_ob + heads[:, None] * stride_oh + d[None, :]
        o_mask = head_mask[:, None] & (d < HEAD_DIM)[None, :]
        tl.store(o_ptrs, cast(out, OUT.dtype.element_ty, EMULATE_BF16), mask=o_mask)


def plan_decode(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    tables: Tensor,
    lens: Tensor,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
    out: Tensor,
    policy: SplitPolicy,
    arch: int | None,
    interpret: bool,
    memo: dict[Any, Any] | None = None,
    *,
    tile: TileConfig | None = None,
    **scales: Tensor | None,
) -> list[Launch]:
    """The decode launch, and the merge launch when contexts may be split.
    ``tables``/``lens`` are int32 on q's device; nothing here reads a tensor.
    ``tile``: instead of :func:`tile_config`'s choice (autotuning).
    ``scales``: ``k_scales``/``v_scales``, an int8 cache's ``[num_blocks,
    block_size, kv_heads]``, or ``k_head_scales``/``v_head_scales``, static
    scales, ``[kv_heads]`` float32 (absent or None for other caches)."""
    batch, heads, _ = q.shape
    head_programs, constexprs, tile, caches, cache_strides = layer_layout(
        "decode", q, k_cache, v_cache, arch, interpret, tile, scales
    )
    block_d = constexprs["BLOCK_D"]
    max_visible = tables.shape[1] * k_cache.shape[1]
    if sliding_window is not None:
        max_visible = min(max_visible, sliding_window)
    splits = policy.grid_splits(max_visible, head_programs)
    # Always real float32 buffers (one row when nothing can split), so the
    # kernel's signature, and the compiled variant, never depend on the step.
    rows = policy.partial_rows(batch, splits, head_programs) if splits > 1 else 1
    part_acc, part_lse = _partials(memo, rows, heads, block_d, q.device)
    window = int(sliding_window or 0)
    use_window = sliding_window is not None
    decode = Launch(
        _decode_kernel,
        (batch, head_programs, splits),
        (
            q, *caches, tables, lens, out, part_acc, part_lse, q.stride(0), q.stride(1),
            *cache_strides, tables.stride(0), out.stride(0), out.stride(1), float(scale),
            float(softcap or 1.0), heads, head_programs, batch, window, policy.min_chunk,
            policy.target_programs, splits, rows,
        ),  # fmt: skip
        dict(constexprs, USE_WINDOW=use_window, USE_SOFTCAP=bool(softcap)),
        tile.num_warps,
        tile.num_stages,
        tile.maxnreg,
    )
    if splits == 1:
        return [decode]
    merge = plan_merge(
        part_acc, part_lse, lens, out, window, head_programs, policy, splits, use_window,
        constexprs["EMULATE_BF16"],
    )  # fmt: skip
    return [decode, merge]


def _partials(
    memo: dict[Any, Any] | None, rows: int, heads: int, block_d: int, device: torch.device
) -> tuple[Tensor, Tensor]:
    """Partial outputs and log-sum-exps of split pieces; with the step's
    ``memo``, allocated once per step and reused by every layer (a layer's
    merge has read them before the next layer's decode writes them)."""
    key = ("paged_triton.decode_partials", rows, heads, block_d)
    if memo is not None and key in memo:
        return memo[key]  # type: ignore[no-any-return]
    buffers = (
        torch.empty(rows, heads, block_d, device=device, dtype=torch.float32),
        torch.empty(rows, heads, device=device, dtype=torch.float32),
    )
    if memo is not None:
        memo[key] = buffers
    return buffers


@op(DecodeArgs)
def paged_decode_attention(a: DecodeArgs) -> Tensor:
    """One query per sequence (``q``: ``[batch, heads, head_dim]``) at position
    ``seq_lens[b] - 1`` over its paged context, read straight from the cache
    blocks (no gather copy). ``seq_lens`` includes the new token; 0 gives
    zeros. Same contract as ``paged_ref.ops.paged_decode_attention``; with
    ``memo`` (the caller's per-step dict) the first layer's checked plan is
    replayed by the others and the split buffers are allocated once per
    step. An 8-bit cache is dequantized tile by tile in registers (int8 with
    ``k_scales``/``v_scales``; static per-head scales with
    ``k_head_scales``/``v_head_scales``, ``[kv_heads]``). Contexts are split
    as :func:`split_policy` says for the device (tests patch it to force splits).
    """
    q, tables, lens = a.q, a.block_tables, a.seq_lens
    scales: dict[str, Any] = a.scale_keywords()
    out = torch.empty_like(q)

    def check() -> bool:
        check_attention(_decode_kernel, q, a.k_cache, a.v_cache, "batch", **scales)
        batch, heads, _ = q.shape
        if tables.dim() != 2 or tables.shape[0] != batch or lens.shape != (batch,):
            raise ValueError(
                f"block_tables must be [batch={batch}, max_blocks] and seq_lens [batch], got "
                f"{tuple(tables.shape)} and {tuple(lens.shape)}"
            )
        return batch > 0 and heads > 0

    def args(arch: int | None) -> tuple[Any, ...]:
        return (
            last_dim_contiguous(q), a.k_cache, a.v_cache, as_index(tables, q), as_index(lens, q),
            a.scale, a.sliding_window, a.softcap, out, split_policy(q.device), arch, _INTERPRETED,
            a.memo,
        )  # fmt: skip

    # q, k, v, k_scale, v_scale, out: arguments 0-4 and 7 of the decode, out 3 of the merge
    where = [(0, 1, 2, 3, 4, 7), (-1, -1, -1, -1, -1, 3)]
    run_planned("decode", plan_decode, (q, a.k_cache, a.v_cache, out), scales, check=check,
                args=args, memo=a.memo, step_key=(id(tables), id(lens), a.scale, a.sliding_window,
                a.softcap), traits=(a.sliding_window is not None, bool(a.softcap)), where=where)  # fmt: skip
    return out


_INTERPRETED = interpreted(_decode_kernel)  # Triton decides once, at import
