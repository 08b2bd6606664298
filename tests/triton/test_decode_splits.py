"""The decode kernel's per-sequence split plan, read back from the device.

A probe kernel runs the same ``split_plan`` device function the decode and
merge kernels call and stores each sequence's piece count and first
partial row, so these tests see exactly what a GPU step would decide, with
an H100's 132 SMs as the policy's target.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from paged_triton.decode_splits import BLOCK_B, WAVES_PER_SM, SplitPolicy, split_plan

H100 = SplitPolicy(target_programs=WAVES_PER_SM * 132)
HEAD_PROGRAMS = 8  # Llama 3.2 3B / Qwen3: 8 kv heads, one program each


@triton.jit
def _probe(
    LENS, OUT, batch, window, head_programs, min_chunk, target_programs, max_splits,
    USE_WINDOW: tl.constexpr, BLOCK_B: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    pieces, row0 = split_plan(
        LENS, b, batch, window, head_programs, min_chunk, target_programs, max_splits,
        USE_WINDOW, BLOCK_B,
    )  # fmt: skip
    tl.store(OUT + 2 * b, pieces)
    tl.store(OUT + 2 * b + 1, row0)


def plan(
    lens: list[int], policy: SplitPolicy = H100, window: int | None = None
) -> tuple[list[int], list[int], int]:
    """(pieces per sequence, first partial row per sequence, the grid's z)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    max_visible = max(lens) if window is None else min(max(lens), window)
    splits = policy.grid_splits(max_visible, HEAD_PROGRAMS)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    out = torch.zeros(len(lens), 2, dtype=torch.int32, device=device)
    _probe[(len(lens),)](
        seq_lens, out, len(lens), window or 0, HEAD_PROGRAMS, policy.min_chunk,
        policy.target_programs, splits, USE_WINDOW=window is not None, BLOCK_B=BLOCK_B,
    )  # fmt: skip
    pieces, rows = out.cpu().t().tolist()
    return pieces, rows, splits


def test_ragged_batch_cuts_only_the_long_sequence_into_even_pieces():
    """One 32k-token sequence among 63 of 1k: the long one is cut so that no
    program reads much more than a short sequence's whole context."""
    lens = [32768] + [1024] * 63
    pieces, rows, splits = plan(lens)
    assert pieces[1:] == [1] * 63
    assert 16 <= pieces[0] <= splits
    assert 32768 / pieces[0] <= 1.5 * 1024
    programs = HEAD_PROGRAMS * sum(pieces)
    # about the target, unless the long one already has the most pieces allowed
    assert programs <= 2 * H100.target_programs
    assert programs >= H100.target_programs or pieces[0] == H100.max_splits
    # Only split sequences take partial rows, and they fit the buffer planned on the host.
    assert rows == [0] + [pieces[0]] * 63
    assert pieces[0] <= H100.partial_rows(len(lens), splits, HEAD_PROGRAMS)


def test_uniform_batch_is_cut_evenly_and_a_large_one_not_at_all():
    """64 x 4k makes 512 programs, under the target: every sequence is cut
    in two (0.283 against 0.324 ms on an H200). 256 x 4k already makes
    2,048: splitting would only add merges."""
    assert plan([4096] * 64)[0] == [2] * 64
    assert plan([4096] * 256)[0] == [1] * 256


def test_small_batch_is_split_to_fill_the_gpu():
    pieces, rows, _ = plan([4096, 4096, 100])
    assert pieces == [16, 16, 1]  # 256-token pieces: min_chunk
    assert rows == [0, 16, 32]  # compact: each split sequence's pieces follow the previous ones'


def test_window_limits_what_is_split():
    pieces, _, _ = plan([32768, 300], window=1024)
    assert pieces == [4, 1]  # 1,024 visible keys in 256-token pieces


@pytest.mark.parametrize("max_splits", [1, 3])
def test_pieces_never_exceed_the_grid(max_splits):
    policy = SplitPolicy(min_chunk=16, target_programs=1 << 20, max_splits=max_splits)
    pieces, _, splits = plan([1000, 500, 20], policy)
    assert splits == max_splits
    assert pieces == [max_splits, max_splits, 1]


def test_host_grid_knows_when_nothing_can_split():
    """From shapes alone: contexts shorter than two pieces, or a target too
    small for two programs per head, mean no split grid and no merge."""
    assert H100.grid_splits(max_visible=511, head_programs=8) == 1
    assert H100.grid_splits(max_visible=512, head_programs=8) == 2
    assert H100.grid_splits(max_visible=1 << 20, head_programs=8) == H100.max_splits
    assert SplitPolicy(target_programs=1).grid_splits(1 << 20, 1) == 1  # the interpreter
    with pytest.raises(ValueError, match=">= 1"):
        SplitPolicy(min_chunk=0)
