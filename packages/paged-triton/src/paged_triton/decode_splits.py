"""Flash-decoding on the device: each sequence's context is cut into pieces
by the kernel itself, and a second kernel merges the pieces.

The host cannot know the batch's lengths without a sync, so the decode
grid has a fixed z extent (``grid_splits``, from shapes alone) and every
program works out on the device, from ``seq_lens``, how many pieces its
sequence gets (:func:`split_plan`):

- one piece size for the whole batch, ``chunk = max(min_chunk,
  ceil(total visible tokens * head programs / target_programs))``, so the
  batch makes about ``target_programs`` programs (a few per SM);
- sequence ``b`` gets ``clamp(visible_b // chunk, 1, max_splits)`` pieces:
  in a ragged batch a 32k-token sequence is cut into many pieces while its
  1k-token neighbours run whole, and every piece holds about the same work;
- programs past their sequence's pieces return at once.

A sequence with one piece writes its output directly; the others write a
normalised partial output and its log-sum-exp (log2 units) into compact
rows (sequence ``b``'s pieces from row ``row0_b``, the pieces of earlier
split sequences before it). At most ``target_programs // head_programs``
rows are ever used, whatever the batch, so the buffer stays small. The
merge weighs each piece by ``2^(lse - max lse)``, exactly the softmax over
the union of the pieces.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from paged_triton.interpreter_bf16 import cast
from paged_triton.launch import Launch

BLOCK_B = 256  # sequences read per step of the plan's scans over seq_lens
MERGE_BLOCK_S = 16  # pieces merged per step


@dataclass(frozen=True, slots=True)
class SplitPolicy:
    """How the decode kernel cuts contexts (see module doc).

    ``min_chunk``: fewest tokens in a piece (pieces start on tile boundaries,
    so below the kernel's tile some pieces would be empty: correct, wasted);
    ``target_programs``: programs a batch should make,
    ``WAVES_PER_SM`` per SM on a GPU; ``max_splits``: most pieces per
    sequence, the decode grid's z extent at most."""

    min_chunk: int = 256
    target_programs: int = 1
    max_splits: int = 32

    def __post_init__(self) -> None:
        if min(self.min_chunk, self.target_programs, self.max_splits) < 1:
            raise ValueError(f"every SplitPolicy field must be >= 1, got {self}")

    def grid_splits(self, max_visible: int, head_programs: int) -> int:
        """The decode grid's z extent from what the host knows without a sync
        (the longest context the block tables can hold, the window): 1 when
        no sequence can be split, so neither partials nor the merge run."""
        if self.target_programs // head_programs < 2:
            return 1
        return max(1, min(self.max_splits, max_visible // self.min_chunk))

    def partial_rows(self, batch: int, grid_splits: int, head_programs: int) -> int:
        """Rows the partial buffers need: the device plan never uses more
        than ``target_programs // head_programs`` (its piece size is chosen
        so) nor more than the grid has."""
        return max(1, min(self.target_programs // head_programs, batch * grid_splits))


# Programs per SM a decode batch aims for: 8 was the fastest on an H200 (the
# sweep is in docs/gpu.md).
WAVES_PER_SM = 8


def split_policy(device: torch.device) -> SplitPolicy:
    """The default policy for ``device``. Triton's interpreter runs programs
    one after another, so splitting never helps there (target 1)."""
    if device.type != "cuda":
        return _CPU_POLICY
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_policy(index)


_CPU_POLICY = SplitPolicy()


@functools.cache
def _cuda_policy(index: int) -> SplitPolicy:
    sms = torch.cuda.get_device_properties(index).multi_processor_count
    return SplitPolicy(target_programs=WAVES_PER_SM * sms)


@triton.jit
def visible_len(seq_len, window, USE_WINDOW: tl.constexpr):
    """Keys the decode query at ``seq_len - 1`` sees: the last ``window``."""
    if USE_WINDOW:
        return tl.minimum(seq_len, window)
    return seq_len


@triton.jit
def split_plan(
    LENS,
    b,
    batch,
    window,
    head_programs,
    min_chunk,
    target_programs,
    max_splits,
    USE_WINDOW: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    """``(pieces, row0)`` of sequence ``b``: how many pieces its context is
    cut into, and the first partial row its pieces use (see module doc).
    Reads ``seq_lens`` twice (a few KB from L2); every program computes the
    same piece size, so the decode and merge kernels agree."""
    total = (b * 0).to(tl.int64)
    for i0 in range(0, batch, BLOCK_B):
        idx = i0 + tl.arange(0, BLOCK_B)
        n = visible_len(tl.load(LENS + idx, mask=idx < batch, other=0), window, USE_WINDOW)
        total += tl.sum(n.to(tl.int64), 0)
    chunk = tl.maximum((total * head_programs + target_programs - 1) // target_programs, min_chunk)
    row0 = b * 0
    for i0 in range(0, b, BLOCK_B):
        idx = i0 + tl.arange(0, BLOCK_B)
        n = visible_len(tl.load(LENS + idx, mask=idx < b, other=0), window, USE_WINDOW)
        pieces = tl.minimum(tl.maximum(n // chunk, 1), max_splits).to(tl.int32)
        row0 += tl.sum(tl.where((idx < b) & (pieces > 1), pieces, 0), 0)
    n_b = visible_len(tl.load(LENS + b), window, USE_WINDOW)
    pieces_b = tl.minimum(tl.maximum(n_b // chunk, 1), max_splits).to(tl.int32)
    return pieces_b, row0


@triton.jit(
    do_not_specialize=["batch", "window", "min_chunk", "target_programs", "max_splits"],
    do_not_specialize_on_alignment=["LENS"],
)
def _merge_splits_kernel(
    PART_ACC,
    PART_LSE,
    LENS,
    OUT,
    stride_ob,
    stride_oh,
    num_heads,
    batch,
    window,
    head_programs,
    min_chunk,
    target_programs,
    max_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_B: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
):
    """Program (b, h): out[b, h] = sum_s w_s * partial_s / sum_s w_s,
    w_s = 2^(lse_s - max lse), over sequence b's pieces; sequences with one
    piece were written by the decode kernel and are skipped."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    n_b = visible_len(tl.load(LENS + b), window, USE_WINDOW)
    if n_b // min_chunk < 2:
        return  # cannot have been split
    pieces, row0 = split_plan(
        LENS, b, batch, window, head_programs, min_chunk, target_programs, max_splits,
        USE_WINDOW, BLOCK_B,
    )  # fmt: skip
    if pieces < 2:
        return
    d = tl.arange(0, BLOCK_D)
    m = tl.full([], float("-inf"), tl.float32)
    total = tl.zeros([], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for s0 in range(0, pieces, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        row = (row0 + s) * num_heads + h
        lse = tl.load(PART_LSE + row, mask=s < pieces, other=float("-inf"))
        part = tl.load(
            PART_ACC + row[:, None] * BLOCK_D + d[None, :], mask=(s < pieces)[:, None], other=0.0
        )
        m_new = tl.maximum(m, tl.max(lse, 0))
        base = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - base)
        w = tl.exp2(lse - base)
        total = total * alpha + tl.sum(w, 0)
        acc = acc * alpha + tl.sum(w[:, None] * part, 0)
        m = m_new
    out = acc / tl.where(total > 0, total, 1.0)
    tl.store(
        OUT + b * stride_ob + h * stride_oh + d,
        cast(out, OUT.dtype.element_ty, EMULATE_BF16),
        mask=d < HEAD_DIM,
    )


def plan_merge(
    part_acc: torch.Tensor,
    part_lse: torch.Tensor,
    lens: torch.Tensor,
    out: torch.Tensor,
    window: int,
    head_programs: int,
    policy: SplitPolicy,
    grid_splits: int,
    use_window: bool,
    emulate_bf16: bool,
) -> Launch:
    """The merge launch for a split decode (grid: batch x heads)."""
    batch, heads, head_dim = out.shape
    return Launch(
        _merge_splits_kernel,
        (batch, heads),
        (
            part_acc,
            part_lse,
            lens,
            out,
            out.stride(0),
            out.stride(1),
            heads,
            batch,
            window,
            head_programs,
            policy.min_chunk,
            policy.target_programs,
            grid_splits,
        ),
        dict(
            HEAD_DIM=head_dim,
            BLOCK_D=part_acc.shape[-1],
            BLOCK_S=MERGE_BLOCK_S,
            BLOCK_B=BLOCK_B,
            USE_WINDOW=use_window,
            EMULATE_BF16=emulate_bf16,
        ),
        num_warps=4,
        num_stages=1,
    )
