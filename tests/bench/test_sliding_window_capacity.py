"""The sliding-window capacity table measures the formula it claims."""

from __future__ import annotations

from paged_server.bench.sliding_window_capacity import sliding_window_capacity_row


def test_hybrid_blocks_follow_global_l_plus_local_window() -> None:
    row = sliding_window_capacity_row(2048, budget_bytes=256 << 20)
    # 4 global layers x 2048 / 16 + 22 local x 512 / 16
    assert row["hybrid_layer_blocks"] == row["formula_layer_blocks"] == 4 * 128 + 22 * 32
    assert row["one_group_layer_blocks"] == 26 * 128
    assert row["hybrid_sequences"] > row["one_group_sequences"] >= 1
