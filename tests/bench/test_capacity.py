"""Capacity table: counts come from admitting sequences into the real pools."""

from __future__ import annotations

import math
import random

import pytest

from paged_server.bench.capacity import (
    KVShape,
    admit_until_full,
    capacity_row,
    capacity_table,
    draw_lengths,
    make_paged_pool,
)

TINY = {"num_slots": 2, "max_seq_len": 64, "block_size": 16, "spread": 0.0}


@pytest.mark.parametrize("length", [1, 16, 17, 20, 32, 48, 64])
def test_exact_lengths_match_block_arithmetic(length: int) -> None:
    row = capacity_row(length, **TINY)
    num_blocks = 2 * 64 // 16
    assert row["contiguous"] == 2  # one sequence per slot, whatever its length
    assert row["paged"] == num_blocks // math.ceil(length / 16)
    assert row["paged_tokens_held"] == row["paged"] * length


def test_paged_never_below_contiguous_and_equal_at_max_len() -> None:
    table = capacity_table((128, 512, 4096), num_slots=4, max_seq_len=4096, block_size=16)
    rows = {r["avg_len_target"]: r for r in table["rows"]}
    assert all(r["paged"] >= r["contiguous"] == 4 for r in rows.values())
    assert rows[4096]["paged"] == 4
    assert rows[128]["paged"] > 8 * rows[128]["contiguous"]
    assert table["settings"]["num_blocks"] == 4 * 4096 // 16
    assert len({r["kv_bytes"] for r in rows.values()}) == 1


def test_draw_lengths_keep_mean_near_target_and_within_bounds() -> None:
    lengths = draw_lengths(3000, 0.5, 4096, random.Random(0), 2000)
    assert all(1 <= n <= 4096 for n in lengths)
    assert abs(sum(lengths) / len(lengths) - 3000) < 60
    with pytest.raises(ValueError, match="max_seq_len"):
        draw_lengths(5000, 0.5, 4096, random.Random(0), 1)


def test_admit_stops_at_first_refusal_and_pool_stays_consistent() -> None:
    pool = make_paged_pool(KVShape(), num_blocks=4, block_size=16)
    admitted = admit_until_full(pool, [32, 16, 32, 1], random.Random(0))
    assert admitted == [32, 16]  # the third needs 2 blocks, only 1 is left
    assert pool.audit() == []
