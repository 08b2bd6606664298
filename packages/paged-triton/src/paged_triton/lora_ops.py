"""LoRA deltas of a mixed batch as Triton kernels: shrink then expand, each
as BGMV for the decode rows and SGMV for the prompt runs (Punica, S-LoRA).

``add_lora`` has ``paged_ref.lora_ops.add_lora``'s signature and result
(``@op(LoRAArgs)``), each row computed with its own slot only (the
reference masks every slot for the decode rows):

- shrink ``h[t] = A[slot(t)] @ x[t]`` into a float32 ``[rows, S * R]``
  buffer. Decode rows: one program per (row, tile of ``h``'s columns, piece
  of ``in``), a gathered matrix-vector product; the pieces (split-K, so a
  single decode row still spreads over many programs) are summed after.
  Prompt runs: one program per (run, tile of ``BLOCK_M`` rows, column
  tile), a GEMM tile against the run's adapter.
- expand ``out[t, cols of i] += B_i[slot(t)] @ h[t, i * R : (i + 1) * R]``
  for each stacked projection ``i`` (a grid axis), the same two ways, reading
  ``out``'s tile, adding the float32 delta and writing it back once.

Rows of slot -1 (the base model) and base runs cost one load and an early
exit. Tiles depend on nothing but the dtype, so one compiled variant per
kernel and dtype serves every adapter rank, model width and batch (the
compile matrix: ``compile_matrix.lora_jobs``). The decode half's grid
depends only on the row count (CUDA-graph safe); the prompt half's on the
longest run, known on the host when the mapping is built.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from paged_ref.lora_ops import LoRAArgs, LoRAMapping, check_lora_args
from paged_ref.op_args import op
from paged_triton.launch import Launch
from paged_triton.launch_checks import check_runnable, dot_precision

__all__ = ["add_lora"]

MAX_SLICES = 3  # q/k/v: the most projections a fused layer stacks
ROWS_BLOCK_N, ROWS_BLOCK_K = 32, 64  # decode shrink: a [32 x 64] weight tile per step
SPLIT_K_CHUNK = 512  # input features per split-K piece, at least
SPLIT_K_PROGRAMS = 128  # split decode shrinks until about this many programs run
SEG_BLOCK_M, SEG_BLOCK_N, SEG_BLOCK_K = 32, 32, 64  # prompt shrink GEMM tile
EXPAND_BLOCK_N, EXPAND_BLOCK_R = 64, 16  # expand: output columns x rank per step


@triton.jit
def _slice_bounds(s, END0, END1, END2):
    """Output columns ``[lo, hi)`` of stacked projection ``s``."""
    lo = tl.where(s == 0, 0, tl.where(s == 1, END0, END1))
    hi = tl.where(s == 0, END0, tl.where(s == 1, END1, END2))
    return lo, hi


@triton.jit(do_not_specialize=["k_per_split", "stride_hs"])  # step-dependent: one variant
def _shrink_rows_kernel(
    X,  # [rows, K]
    A,  # [slots, N, K]
    H,  # [SPLIT, rows, N] float32
    SLOTS,  # [rows] int32
    N,
    K,
    k_per_split,
    stride_xm,
    stride_as,
    stride_an,
    stride_hs,
    stride_hm,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    slot = tl.load(SLOTS + row).to(tl.int64)
    if slot < 0:
        return
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_begin = split * k_per_split
    x_row = X + row.to(tl.int64) * stride_xm
    a_slot = A + slot * stride_as + n[:, None].to(tl.int64) * stride_an
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, k_per_split, BLOCK_K):
        kk = k_begin + k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_row + kk, mask=kk < K, other=0.0).to(tl.float32)
        a = tl.load(a_slot + kk[None, :], mask=(n < N)[:, None] & (kk < K)[None, :], other=0.0)
        acc += tl.sum(a.to(tl.float32) * x[None, :], axis=1)
    tl.store(H + split * stride_hs + row.to(tl.int64) * stride_hm + n, acc, mask=n < N)


@triton.jit
def _segment_tile(SEG_STARTS, SEG_SLOTS, m_tiles, BLOCK_M: tl.constexpr):
    """This program's tile of its segment (axis 0 walks ``m_tiles`` tiles
    per segment): its first row, the segment's end and its slot."""
    seg = tl.program_id(0) // m_tiles
    first = tl.load(SEG_STARTS + seg) + (tl.program_id(0) % m_tiles) * BLOCK_M
    end = tl.load(SEG_STARTS + seg + 1)
    slot = tl.load(SEG_SLOTS + seg).to(tl.int64)
    return first, end, slot


@triton.jit(do_not_specialize=["m_tiles"])
def _shrink_segments_kernel(
    X,  # [rows, K]
    A,  # [slots, N, K]
    H,  # [rows, N] float32
    SEG_STARTS,  # [segments + 1] int32
    SEG_SLOTS,  # [segments] int32
    N,
    K,
    m_tiles,
    stride_xm,
    stride_as,
    stride_an,
    stride_hm,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    first, end, slot = _segment_tile(SEG_STARTS, SEG_SLOTS, m_tiles, BLOCK_M)
    if slot < 0 or first >= end:
        return
    rows = first + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    x_rows = X + rows[:, None].to(tl.int64) * stride_xm
    a_slot = A + slot * stride_as + n[None, :].to(tl.int64) * stride_an
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + k
        x = tl.load(x_rows + kk[None, :], mask=(rows < end)[:, None] & (kk < K)[None, :], other=0.0)
        a = tl.load(a_slot + kk[:, None], mask=(n < N)[None, :] & (kk < K)[:, None], other=0.0)
        acc = tl.dot(x, a, acc, input_precision=PRECISION)
    out = H + rows[:, None].to(tl.int64) * stride_hm + n[None, :]
    tl.store(out, acc, mask=(rows < end)[:, None] & (n < N)[None, :])


@triton.jit
def _expand_rows_kernel(
    H,  # [rows, S * R] float32
    B,  # [out, slots, R]
    OUT,  # [rows, out]
    SLOTS,  # [rows] int32
    R,
    END0,
    END1,
    END2,
    stride_hm,
    stride_bn,
    stride_bs,
    stride_om,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    row = tl.program_id(0)
    s = tl.program_id(2)
    slot = tl.load(SLOTS + row).to(tl.int64)
    lo, hi = _slice_bounds(s, END0, END1, END2)
    first = lo + tl.program_id(1) * BLOCK_N
    if slot < 0 or first >= hi:
        return
    n = first + tl.arange(0, BLOCK_N)
    h_row = H + row.to(tl.int64) * stride_hm + s * R
    b_rows = B + n[:, None].to(tl.int64) * stride_bn + slot * stride_bs
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        h = tl.load(h_row + r, mask=r < R, other=0.0)
        b = tl.load(b_rows + r[None, :], mask=(n < hi)[:, None] & (r < R)[None, :], other=0.0)
        acc += tl.sum(b.to(tl.float32) * h[None, :], axis=1)
    out = OUT + row.to(tl.int64) * stride_om + n
    old = tl.load(out, mask=n < hi, other=0.0)
    tl.store(out, (old.to(tl.float32) + acc).to(OUT.dtype.element_ty), mask=n < hi)


@triton.jit(do_not_specialize=["m_tiles"])
def _expand_segments_kernel(
    H,  # [rows, S * R] float32
    B,  # [out, slots, R]
    OUT,  # [rows, out]
    SEG_STARTS,  # [segments + 1] int32
    SEG_SLOTS,  # [segments] int32
    R,
    END0,
    END1,
    END2,
    m_tiles,
    stride_hm,
    stride_bn,
    stride_bs,
    stride_om,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    first, end, slot = _segment_tile(SEG_STARTS, SEG_SLOTS, m_tiles, BLOCK_M)
    s = tl.program_id(2)
    lo, hi = _slice_bounds(s, END0, END1, END2)
    first_n = lo + tl.program_id(1) * BLOCK_N
    if slot < 0 or first >= end or first_n >= hi:
        return
    rows = first + tl.arange(0, BLOCK_M)
    n = first_n + tl.arange(0, BLOCK_N)
    h_rows = H + rows[:, None].to(tl.int64) * stride_hm + s * R
    b_cols = B + n[None, :].to(tl.int64) * stride_bn + slot * stride_bs
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        h = tl.load(h_rows + r[None, :], mask=(rows < end)[:, None] & (r < R)[None, :], other=0.0)
        b = tl.load(b_cols + r[:, None], mask=(n < hi)[None, :] & (r < R)[:, None], other=0.0)
        acc = tl.dot(h.to(B.dtype.element_ty), b, acc, input_precision=PRECISION)
    mask = (rows < end)[:, None] & (n < hi)[None, :]
    out = OUT + rows[:, None].to(tl.int64) * stride_om + n[None, :]
    old = tl.load(out, mask=mask, other=0.0)
    tl.store(out, (old.to(tl.float32) + acc).to(OUT.dtype.element_ty), mask=mask)


def split_k(rows: int, n: int, k: int) -> int:
    """Pieces of ``in`` the decode shrink is cut into: enough programs to
    fill a GPU when few rows decode, never a piece under ``SPLIT_K_CHUNK``."""
    programs = rows * triton.cdiv(n, ROWS_BLOCK_N)
    return max(1, min(triton.cdiv(k, SPLIT_K_CHUNK), SPLIT_K_PROGRAMS // max(programs, 1)))


def _ends(slice_sizes: tuple[int, ...]) -> tuple[int, int, int]:
    ends, at = [], 0
    for size in slice_sizes:
        at += size
        ends.append(at)
    return tuple(ends + [at] * (MAX_SLICES - len(ends)))  # type: ignore[return-value]


def plan_lora(
    x: Tensor,
    out: Tensor,
    lora_a: Tensor,
    lora_b: Tensor,
    slice_sizes: tuple[int, ...],
    mapping: LoRAMapping,
    h: Tensor,
    partial: Tensor | None,
) -> list[Launch]:
    """The launches of one projection's delta (``x``/``out`` 2-D): the
    decode rows' shrink into ``partial [split, decode_rows, S * R]`` (or
    straight into ``h`` when not split), the runs' shrink into ``h [rows,
    S * R]``, then both expands into ``out``. The caller sums ``partial``
    into ``h`` between the shrinks and the expands."""
    slots, n, k = lora_a.shape
    rank = n // len(slice_sizes)
    ends = _ends(slice_sizes)
    widest = max(slice_sizes)
    precision = dot_precision(x.dtype)
    launches: list[Launch] = []
    rows = mapping.decode_rows
    m_tiles = triton.cdiv(mapping.max_segment_len, SEG_BLOCK_M)
    segments = mapping.num_segments
    if rows:
        dest = h if partial is None else partial
        split = 1 if partial is None else partial.shape[0]
        per_split = triton.cdiv(triton.cdiv(k, split), ROWS_BLOCK_K) * ROWS_BLOCK_K
        launches.append(Launch(
            _shrink_rows_kernel, (rows, triton.cdiv(n, ROWS_BLOCK_N), split),
            (x, lora_a, dest, mapping.token_slots, n, k, per_split, x.stride(0),
             lora_a.stride(0), lora_a.stride(1), dest.stride(0) if partial is not None else 0,
             dest.stride(-2)),
            dict(BLOCK_N=ROWS_BLOCK_N, BLOCK_K=ROWS_BLOCK_K), num_warps=4, num_stages=2,
        ))  # fmt: skip
    if m_tiles:
        launches.append(Launch(
            _shrink_segments_kernel, (segments * m_tiles, triton.cdiv(n, SEG_BLOCK_N)),
            (x, lora_a, h, mapping.segment_starts, mapping.segment_slots, n, k, m_tiles,
             x.stride(0), lora_a.stride(0), lora_a.stride(1), h.stride(0)),
            dict(PRECISION=precision, BLOCK_M=SEG_BLOCK_M, BLOCK_N=SEG_BLOCK_N,
                 BLOCK_K=SEG_BLOCK_K), num_warps=4, num_stages=3,
        ))  # fmt: skip
    n_tiles = triton.cdiv(widest, EXPAND_BLOCK_N)
    if rows:
        launches.append(Launch(
            _expand_rows_kernel, (rows, n_tiles, len(slice_sizes)),
            (h, lora_b, out, mapping.token_slots, rank, *ends, h.stride(0), lora_b.stride(0),
             lora_b.stride(1), out.stride(0)),
            dict(BLOCK_N=EXPAND_BLOCK_N, BLOCK_R=EXPAND_BLOCK_R), num_warps=4, num_stages=2,
        ))  # fmt: skip
    if m_tiles:
        launches.append(Launch(
            _expand_segments_kernel, (segments * m_tiles, n_tiles, len(slice_sizes)),
            (h, lora_b, out, mapping.segment_starts, mapping.segment_slots, rank, *ends, m_tiles,
             h.stride(0), lora_b.stride(0), lora_b.stride(1), out.stride(0)),
            dict(PRECISION=precision, BLOCK_M=SEG_BLOCK_M, BLOCK_N=EXPAND_BLOCK_N,
                 BLOCK_R=EXPAND_BLOCK_R), num_warps=4, num_stages=2,
        ))  # fmt: skip
    return launches


@op(LoRAArgs)
def add_lora(a: LoRAArgs) -> None:
    """Add each row's LoRA delta to ``out`` in place, each row computed with
    its own slot's A and B only (``paged_ref.lora_ops.add_lora``'s result)."""
    x, out, _ = check_lora_args(a)
    check_runnable(_shrink_rows_kernel, x, out, a.lora_a, a.lora_b, a.mapping.token_slots)
    if len(a.slice_sizes) > MAX_SLICES:
        raise ValueError(f"at most {MAX_SLICES} stacked projections, got {len(a.slice_sizes)}")
    if any(t.stride(-1) != 1 for t in (x, out, a.lora_a, a.lora_b)):
        raise ValueError("x, out, lora_a and lora_b need their last dimension contiguous")
    m = a.mapping
    n, k = a.lora_a.shape[1], a.lora_a.shape[2]
    h = torch.empty(x.shape[0], n, dtype=torch.float32, device=x.device)
    split = split_k(m.decode_rows, n, k) if m.decode_rows else 1
    partial = (
        torch.empty(split, m.decode_rows, n, dtype=torch.float32, device=x.device)
        if split > 1
        else None
    )
    launches = plan_lora(x, out, a.lora_a, a.lora_b, a.slice_sizes, m, h, partial)
    shrink = (_shrink_rows_kernel, _shrink_segments_kernel)
    shrinks = sum(launch.kernel in shrink for launch in launches)
    for launch in launches[:shrinks]:
        launch.run()
    if partial is not None:
        torch.sum(partial, 0, out=h[: m.decode_rows])
    for launch in launches[shrinks:]:
        launch.run()
