"""Flash-decoding support: how many pieces to cut a context into, and the
kernel that merges the pieces' partial outputs.

Each split of the decode kernel leaves a normalised partial output and its
log-sum-exp (log2 units); merging weighs each by ``2^(lse - max lse)``, which
is exactly the softmax over the union of the pieces.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

MIN_TOKENS_PER_SPLIT = 256  # below this the merge costs more than the split saves
MAX_SPLITS = 64


@triton.jit
def _merge_splits_kernel(
    PART_ACC,
    PART_LSE,
    OUT,
    stride_ob,
    stride_oh,
    num_splits,
    heads,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """out = sum_s w_s * partial_s / sum_s w_s with w_s = 2^(lse_s - max lse);
    splits that saw no key carry lse = -inf and weigh nothing."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    row = (b * heads + h) * num_splits + s
    lse = tl.load(PART_LSE + row, mask=s < num_splits, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))
    part = tl.load(
        PART_ACC + row[:, None] * BLOCK_D + d[None, :], mask=(s < num_splits)[:, None], other=0.0
    )
    total = tl.sum(w, 0)
    out = tl.sum(w[:, None] * part, 0) / tl.where(total > 0, total, 1.0)
    tl.store(
        OUT + b * stride_ob + h * stride_oh + d, out.to(OUT.dtype.element_ty), mask=d < HEAD_DIM
    )


def choose_num_splits(programs: int, max_context: int, num_sms: int) -> int:
    """How many pieces to cut each sequence's context into.

    Enough programs to cover the GPU about twice over (``2 * num_sms``) keeps
    every SM busy; each piece must still hold ``MIN_TOKENS_PER_SPLIT`` tokens
    so the merge stays cheap. Large batches get 1 (no split, no merge).
    """
    if programs <= 0 or programs >= num_sms:
        return 1
    wanted = triton.cdiv(2 * num_sms, programs)
    fits = triton.cdiv(max_context, MIN_TOKENS_PER_SPLIT)
    return max(1, min(wanted, fits, MAX_SPLITS))


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (looked up once per GPU)."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return _cuda_sms(index)
    return 1  # the interpreter runs programs one after another: splitting never helps


@functools.cache
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def merge_splits(part_acc: Tensor, part_lse: Tensor, out: Tensor) -> None:
    """Write into ``out`` (``[batch, heads, head_dim]``) the merge of
    ``part_acc`` (``[batch, heads, splits, padded head_dim]`` float32) and
    ``part_lse`` (``[batch, heads, splits]``)."""
    batch, heads, num_splits, block_d = part_acc.shape
    _merge_splits_kernel[(batch, heads)](
        part_acc,
        part_lse,
        out,
        out.stride(0),
        out.stride(1),
        num_splits,
        heads,
        HEAD_DIM=out.shape[2],
        BLOCK_D=block_d,
        BLOCK_S=triton.next_power_of_2(num_splits),
        num_warps=4,
    )
