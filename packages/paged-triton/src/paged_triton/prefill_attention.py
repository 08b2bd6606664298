"""Paged prefill attention: packed (varlen) queries over cached + new context.

Covers chunked prefill and prompts with prefix-cache hits: the new tokens'
K/V are already in the cache (``write_kv`` first), and query ``i`` of a
sequence sits at position ``seq_len - q_len + i`` (causal with an offset).

A program takes ``BLOCK_Q`` consecutive queries of one sequence and the
``Q_PER_KV`` query heads sharing one kv head, stacked as ``BLOCK_Q * HEADS_PAD``
rows, so each K/V tile read through the page table serves all of them. The grid
has ``total_q // BLOCK_Q + batch`` programs along the query axis, an upper
bound on the per-sequence tiles that needs no device sync; each program
finds its sequence by binary search over ``cu_seqlens_q`` and idle ones
return at once.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from paged_ref.op_args import PrefillArgs, op
from paged_triton.attention_layout import check_attention, layer_layout
from paged_triton.attention_tile import attend_context
from paged_triton.interpreter_bf16 import cast
from paged_triton.launch import Launch, run_planned
from paged_triton.launch_checks import as_index, interpreted, last_dim_contiguous
from paged_triton.tile_config import TileConfig

# Arguments that change from step to step: never specialised (no mid-serving compiles).
PER_STEP_INTS = ["stride_btb", "batch", "window"]
PER_STEP_POINTERS = ["BT", "CU_Q", "LENS"]  # views into the step's packed metadata


@triton.jit(do_not_specialize=PER_STEP_INTS, do_not_specialize_on_alignment=PER_STEP_POINTERS)
def _prefill_kernel(
    Q,
    K,
    V,
    K_SCALE,
    V_SCALE,
    BT,
    CU_Q,
    LENS,
    OUT,
    stride_qt,
    stride_qh,
    stride_cb,
    stride_ch,
    stride_ct,
    stride_sb,
    stride_st,
    stride_btb,
    stride_ot,
    stride_oh,
    scale,
    softcap,
    window,
    batch,
    Q_PER_KV: tl.constexpr,
    HEADS_PER_PROG: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    PRECISION: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
    KV_QUANT: tl.constexpr,
    HEAD_SCALES: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_h = tl.program_id(1)

    # Sequence b owns query tiles from cu_q[b] // BLOCK_Q + b on: find the last b at or before pid.
    lo_b = pid * 0
    hi_b = lo_b + batch - 1
    while lo_b < hi_b:
        mid = (lo_b + hi_b + 1) // 2
        if tl.load(CU_Q + mid) // BLOCK_Q + mid <= pid:
            lo_b = mid
        else:
            hi_b = mid - 1
    b = lo_b
    q_start = tl.load(CU_Q + b)
    q_len = tl.load(CU_Q + b + 1) - q_start
    q_tile = pid - (q_start // BLOCK_Q + b)
    if q_tile * BLOCK_Q >= q_len:
        return

    head_blocks: tl.constexpr = (Q_PER_KV + HEADS_PER_PROG - 1) // HEADS_PER_PROG
    kv_head = pid_h // head_blocks
    first = (pid_h % head_blocks) * HEADS_PER_PROG

    BLOCK_ROWS: tl.constexpr = BLOCK_Q * HEADS_PAD
    r = tl.arange(0, BLOCK_ROWS)
    qi = q_tile * BLOCK_Q + r // HEADS_PAD
    qh = r % HEADS_PAD  # query head in this program
    row_mask = (qi < q_len) & (qh < HEADS_PER_PROG) & (first + qh < Q_PER_KV)
    heads = kv_head * Q_PER_KV + first + qh
    tokens = (q_start + qi).to(tl.int64)

    # Absolute positions of this tile's queries, and the keys any of them can see.
    seq_len = tl.load(LENS + b)
    context_start = seq_len - q_len
    pos = context_start + qi
    first_pos = context_start + q_tile * BLOCK_Q
    hi = tl.minimum(first_pos + BLOCK_Q, seq_len)
    lo = seq_len * 0
    # Keys every query of the tile sees (up to the first query's position, from the
    # last one's window on): whole tiles of them skip the masks in attend_context.
    full_start = lo
    if USE_WINDOW:
        lo = tl.maximum(first_pos - window + 1, 0)
        full_start = tl.minimum(tl.cdiv(tl.maximum(hi - window, 0), BLOCK_N) * BLOCK_N, hi)
    full_end = full_start + tl.maximum(first_pos + 1 - full_start, 0) // BLOCK_N * BLOCK_N
    out, _, _ = attend_context(
        Q + tokens * stride_qt + heads * stride_qh, row_mask, pos, K, V, K_SCALE, V_SCALE,
        BT + b.to(tl.int64) * stride_btb, kv_head, kv_head.to(tl.int64) * stride_ch, lo, hi,
        full_start, full_end, window, stride_cb, stride_ct, stride_sb, stride_st, scale, softcap, BLOCK_ROWS, HEAD_DIM,
        BLOCK_D, BLOCK_SIZE, BLOCK_N, True, USE_WINDOW, USE_SOFTCAP, PRECISION, EMULATE_BF16,
        KV_QUANT, HEAD_SCALES,
    )  # fmt: skip
    d = tl.arange(0, BLOCK_D)
    o_mask = row_mask[:, None] & (d < HEAD_DIM)[None, :]
    o_ptrs = OUT + tokens[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :]
    tl.store(o_ptrs, cast(out, OUT.dtype.element_ty, EMULATE_BF16), mask=o_mask)


def plan_prefill(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    tables: Tensor,
    cu_q: Tensor,
    lens: Tensor,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
    out: Tensor,
    arch: int | None,
    interpret: bool,
    *,
    tile: TileConfig | None = None,
    **scales: Tensor | None,
) -> Launch:
    """The prefill launch; ``tables``/``cu_q``/``lens`` are int32 on q's
    device. The grid's ``total_q // BLOCK_Q + batch`` query programs bound
    the per-sequence tiles without reading ``cu_seqlens_q``. ``tile``:
    instead of :func:`tile_config`'s choice (autotuning); ``scales``: as
    :func:`paged_triton.decode_attention.plan_decode`'s."""
    head_programs, constexprs, tile, caches, cache_strides = layer_layout(
        "prefill", q, k_cache, v_cache, arch, interpret, tile, scales
    )
    batch = lens.shape[0]
    return Launch(
        _prefill_kernel,
        (q.shape[0] // constexprs["BLOCK_Q"] + batch, head_programs),
        (
            q, *caches, tables, cu_q, lens, out, q.stride(0), q.stride(1), *cache_strides,
            tables.stride(0), out.stride(0), out.stride(1), float(scale), float(softcap or 1.0),
            int(sliding_window or 0), batch,
        ),  # fmt: skip
        dict(constexprs, USE_WINDOW=sliding_window is not None, USE_SOFTCAP=bool(softcap)),
        tile.num_warps,
        tile.num_stages,
        tile.maxnreg,
    )


@op(PrefillArgs)
def paged_prefill_attention(a: PrefillArgs) -> Tensor:
    """Packed queries (``q``: ``[total_q, heads, head_dim]``; sequence ``b``
    owns rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``) attending causally to
    their paged context, whose K/V (new tokens included) are already in the
    cache. Same contract as ``paged_ref.ops.paged_prefill_attention``; rows
    that see no key are zeros. With ``memo`` (the caller's per-step dict)
    the first layer's checked plan is replayed by the others. An 8-bit cache
    is dequantized tile by tile in registers (int8 with ``k_scales``/``v_scales``;
    static per-head scales with ``k_head_scales``/``v_head_scales``, ``[kv_heads]``).
    """
    q, tables, cu_q, lens = a.q, a.block_tables, a.cu_seqlens_q, a.seq_lens
    scales: dict[str, Any] = a.scale_keywords()
    out = torch.zeros_like(q)  # rows past cu_seqlens_q[-1], if any, stay zero

    def check() -> bool:
        check_attention(_prefill_kernel, q, a.k_cache, a.v_cache, "total_q", **scales)
        total_q, heads, _ = q.shape
        batch = lens.shape[0]
        if cu_q.shape != (batch + 1,) or tables.dim() != 2 or tables.shape[0] != batch:
            raise ValueError(
                f"with {batch} sequences, cu_seqlens_q must be [{batch + 1}] and block_tables "
                f"[{batch}, max_blocks]; got {tuple(cu_q.shape)} and {tuple(tables.shape)}"
            )
        return total_q > 0 and batch > 0 and heads > 0

    def args(arch: int | None) -> tuple[Any, ...]:
        return (
            last_dim_contiguous(q), a.k_cache, a.v_cache, as_index(tables, q), as_index(cu_q, q),
            as_index(lens, q), a.scale, a.sliding_window, a.softcap, out, arch, _INTERPRETED,
        )  # fmt: skip

    run_planned("prefill", lambda *p, **kw: [plan_prefill(*p, **kw)], (q, a.k_cache, a.v_cache, out),
                scales, check=check, args=args, memo=a.memo, step_key=(id(tables), id(cu_q),
                id(lens), a.scale, a.sliding_window, a.softcap),
                traits=(a.sliding_window is not None, bool(a.softcap)),
                where=[(0, 1, 2, 3, 4, 8)])  # q, k, v, k_scale, v_scale, out  # fmt: skip
    return out


_INTERPRETED = interpreted(_prefill_kernel)  # Triton decides once, at import
