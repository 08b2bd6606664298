"""Fused mixture-of-experts GEMMs: every (token, expert) pair of a step in
one launch per projection, each program one expert's tile of pairs.

The pairs are sorted by expert on the device and each expert's run padded
to a whole ``BLOCK_M`` tile (vLLM's ``moe_align_block_size``), so a program
reads its expert id, gathers its rows of activations and multiplies them
by that expert's weight tile. No host sync and no step-dependent shape
beyond the token count: the padded length has the static bound
``pairs + experts * (BLOCK_M - 1)``.

``fused_experts`` computes what ``paged_server.models.moe.Experts``'
grouped path does (the reference; ``tests/triton/test_fused_moe.py`` runs
both on the same inputs under the interpreter): gate/up GEMM, ``act(gate)
* up``, down GEMM scaled by the routing weight, summed over the chosen
experts. The compile matrix compiles :func:`plan_expert_gemm` for the
published MoE shapes (``moe_jobs``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl
from torch import Tensor

from paged_triton.launch import Launch
from paged_triton.launch_checks import check_runnable, dot_precision

BLOCK_M = 16  # pairs per tile: decode steps route few tokens to each expert
BLOCK_N = 64
BLOCK_K = 64


@triton.jit
def _expert_gemm_kernel(
    A,  # [rows, K]: tokens (ROW_PER_PAIR=False) or pairs
    W,  # [E, N, K]
    C,  # [pairs, N]
    SORTED,  # [padded] int32: pair ids grouped by expert; >= num_pairs is padding
    BLOCK_EXPERT,  # [padded / BLOCK_M] int32: each tile's expert (-1: no work)
    WEIGHTS,  # [pairs] float32 routing weights (MUL_WEIGHT)
    num_pairs,
    N,
    K,
    stride_am,
    stride_we,
    stride_wn,
    stride_cm,
    TOP_K: tl.constexpr,
    ROW_PER_PAIR: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(BLOCK_EXPERT + pid_m).to(tl.int64)
    if expert < 0:
        return
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(SORTED + m)
    valid = pair < num_pairs
    row = pair if ROW_PER_PAIR else pair // TOP_K
    row = tl.where(valid, row, 0).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w_base = W + expert * stride_we
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + k
        a = tl.load(
            A + row[:, None] * stride_am + kk[None, :],
            mask=valid[:, None] & (kk < K)[None, :],
            other=0.0,
        )
        w = tl.load(
            w_base + n[None, :] * stride_wn + kk[:, None],
            mask=(n < N)[None, :] & (kk < K)[:, None],
            other=0.0,
        )
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
    if MUL_WEIGHT:
        acc = acc * tl.load(WEIGHTS + pair, mask=valid, other=0.0)[:, None]
    out = C + pair.to(tl.int64)[:, None] * stride_cm + n[None, :]
    tl.store(out, acc.to(C.dtype.element_ty), mask=valid[:, None] & (n < N)[None, :])


def align_to_experts(ids: Tensor, num_experts: int, block_m: int = BLOCK_M) -> tuple[Tensor, Tensor]:
    """``ids [tokens, top_k]`` -> (sorted pair ids padded per expert to whole
    ``block_m`` tiles, each tile's expert or -1), on ids' device with no
    host sync. Padding entries hold ``tokens * top_k``."""
    flat = ids.flatten()
    pairs = flat.numel()
    order = torch.argsort(flat, stable=True)
    # scatter_add, not bincount: bincount on CUDA reads the max back to the host.
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    start = torch.cumsum(counts, 0) - counts
    capacity = pairs + num_experts * (block_m - 1)
    capacity = (capacity + block_m - 1) // block_m * block_m
    expert_of_sorted = flat[order]
    rank = torch.arange(pairs, device=ids.device) - start[expert_of_sorted]
    position = padded_end[expert_of_sorted] - padded[expert_of_sorted] + rank
    sorted_ids = torch.full((capacity,), pairs, dtype=torch.int32, device=ids.device)
    sorted_ids[position] = order.to(torch.int32)
    tile_start = torch.arange(0, capacity, block_m, device=ids.device)
    block_expert = torch.searchsorted(padded_end, tile_start, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_ids, block_expert


def plan_expert_gemm(
    a: Tensor,
    w: Tensor,
    out: Tensor,
    sorted_ids: Tensor,
    block_expert: Tensor,
    weights: Tensor | None,
    top_k: int,
    row_per_pair: bool,
) -> Launch:
    """``out[p] = a[row(p)] @ w[expert(p)].T`` (times ``weights[p]``) for
    every pair ``p``; ``row(p)`` is ``p // top_k`` (token rows) or ``p``."""
    num_pairs, n = out.shape
    k = a.shape[1]
    return Launch(
        _expert_gemm_kernel,
        (block_expert.shape[0], triton.cdiv(n, BLOCK_N)),
        (
            a, w, out, sorted_ids, block_expert, weights if weights is not None else out,
            num_pairs, n, k, a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        ),  # fmt: skip
        dict(
            TOP_K=top_k,
            ROW_PER_PAIR=row_per_pair,
            MUL_WEIGHT=weights is not None,
            PRECISION=dot_precision(a.dtype),
            BLOCK_M=BLOCK_M,
            BLOCK_N=BLOCK_N,
            BLOCK_K=BLOCK_K,
        ),
        num_warps=4,
        num_stages=3,
    )


def fused_experts(
    x: Tensor,
    w13: Tensor,
    w2: Tensor,
    weights: Tensor,
    ids: Tensor,
    act: Callable[[Tensor], Tensor],
) -> Tensor:
    """``x [T, hidden]`` through the experts ``ids [T, top_k]`` chose, mixed
    by ``weights [T, top_k]`` (float32): ``w13 [E, 2I, hidden]`` (gate rows
    then up rows), ``w2 [E, hidden, I]``. Returns ``[T, hidden]`` in x's
    dtype (a rank's partial sum under tensor parallelism)."""
    check_runnable(_expert_gemm_kernel, x, w13, w2, ids)
    tokens, top_k = ids.shape
    num_experts, two_i, _ = w13.shape
    x, w13, w2 = _rows(x), _rows(w13), _rows(w2)
    sorted_ids, block_expert = align_to_experts(ids, num_experts)
    pairs = tokens * top_k
    h = torch.empty(pairs, two_i, dtype=x.dtype, device=x.device)
    plan_expert_gemm(x, w13, h, sorted_ids, block_expert, None, top_k, False).run()
    gate, up = h.chunk(2, dim=-1)
    a = (act(gate) * up).contiguous()
    y = torch.empty(pairs, w2.shape[1], dtype=x.dtype, device=x.device)
    flat_weights = weights.reshape(-1).to(torch.float32).contiguous()
    plan_expert_gemm(a, w2, y, sorted_ids, block_expert, flat_weights, top_k, True).run()
    return y.view(tokens, top_k, -1).sum(dim=1)


def _rows(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()

