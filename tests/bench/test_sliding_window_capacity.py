"""The sliding-window capacity table measures the formula it claims."""

from __future__ import annotations

from paged_server.bench.sliding_window_capacity import sliding_window_capacity_row


def test_hybrid_blocks_follow_global_l_plus_local_window() -> None:
    row = sliding_window_capacity_row(2048, budget_bytes=256 << 20)
    # 4 global layers x 2048 / 16 + 22 local x 512 / 16
    assert row["hybrid_layer_blocks"] == row["formula_layer_blocks"] == 4 * 128 + 22 * 32
    assert row["one_group_layer_blocks"] == 26 * 128
    assert row["hybrid_sequences"] > row["one_group_sequences"] >= 1


def test_int4_with_the_hybrid_manager_fits_15x_the_sequences_at_8k() -> None:
    """Gemma 3 1B at 8k in 1 GiB: hybrid groups (4.8x fewer bytes per
    sequence) times int4 blocks of 64 (3.56x the tokens of 16 bits)."""
    row = sliding_window_capacity_row(8192, budget_bytes=1 << 30, int4_block_size=64)
    assert row["one_group_sequences"] == 4
    assert row["int4_saving"] >= 15 and row["int4_hybrid_vs_one_group"] >= 15
    assert row["hybrid_int4_sequences"] > 3 * row["hybrid_sequences"]
