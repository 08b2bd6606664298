"""Capacity table: counts come from admitting sequences into the real pools."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from paged_server.bench.capacity import (
    KVShape,
    admit_until_full,
    capacity_row,
    capacity_table,
    default_avg_lengths,
    draw_lengths,
    make_paged_pool,
)

TINY = {"num_rows": 2, "max_model_len": 64, "block_size": 16, "spread": 0.0}


@pytest.mark.parametrize("length", [1, 16, 17, 20, 32, 48, 64])
def test_exact_lengths_match_block_arithmetic(length: int) -> None:
    row = capacity_row(length, **TINY)
    num_blocks = 2 * 64 // 16
    assert row["contiguous"] == 2  # one sequence per row, whatever its length
    assert row["paged"] == num_blocks // math.ceil(length / 16)
    assert row["paged_tokens_held"] == row["paged"] * length


def test_paged_never_below_contiguous_and_equal_at_max_len() -> None:
    table = capacity_table((128, 512, 4096), num_rows=4, max_model_len=4096, block_size=16)
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
    with pytest.raises(ValueError, match="max_model_len"):
        draw_lengths(5000, 0.5, 4096, random.Random(0), 1)


def test_admit_stops_at_first_refusal_and_pool_stays_consistent() -> None:
    pool = make_paged_pool(KVShape(), num_blocks=4, block_size=16)
    admitted = admit_until_full(pool, [32, 16, 32, 1], random.Random(0))
    assert admitted == [32, 16]  # the third needs 2 blocks, only 1 is left
    assert pool.audit() == []


def test_default_lengths_follow_max_model_len() -> None:
    """Doubling from max_model_len / 32 up to max_model_len: the old fixed list at 4096."""
    assert default_avg_lengths(4096) == (128, 256, 512, 1024, 2048, 4096)
    assert default_avg_lengths(1024) == (32, 64, 128, 256, 512, 1024)
    assert default_avg_lengths(16) == (1, 2, 4, 8, 16)
    table = capacity_table(max_model_len=64, num_rows=2, block_size=16)
    assert [r["avg_len_target"] for r in table["rows"]] == [2, 4, 8, 16, 32, 64]


def test_cli_capacity_with_a_short_max_model_len(
    tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--capacity --max-model-len 1024`` failed: the table's averages went to 4096."""
    from paged_server.bench import main

    rc = main(
        ["--model", str(tiny_model_dir), "--capacity", "--kv-rows", "2", "--max-model-len", "64",
         "--block-size", "16", "--workload", "seed", "--num-requests", "1", "--prompt-scale", "0.1",
         "--max-new-tokens-scale", "0.02", "--configs", "paged", "--max-batch-size", "4",
         "--max-num-batched-tokens", "64", "--attention-backend", "ref", "--dtype", "float32"]
    )
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    (table,) = [x for x in map(json.loads, captured.out.splitlines()) if x["kind"] == "capacity"]
    assert table["settings"]["max_model_len"] == 64
    rows = table["rows"]
    assert rows[-1]["avg_len_target"] == 64 and rows[-1]["paged"] == rows[-1]["contiguous"] == 2


def test_bench_flags_before_the_rename_still_parse() -> None:
    """``--kv-slots`` / ``--kv-slot-len`` (the names from before a contiguous row
    and a token slot got a name each) set what ``--kv-rows`` / ``--max-model-len``
    set, and only the new names are in the help."""
    from paged_server.bench.cli import build_parser

    old = build_parser().parse_args(["--kv-slots", "3", "--kv-slot-len", "256"])
    new = build_parser().parse_args(["--kv-rows", "3", "--max-model-len", "256"])
    assert (old.kv_rows, old.max_model_len) == (new.kv_rows, new.max_model_len) == (3, 256)
    defaults = build_parser().parse_args([])
    assert (defaults.kv_rows, defaults.max_model_len) == (8, 4096)
    assert "--kv-slots" not in build_parser().format_help()
