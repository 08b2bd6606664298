"""Tile configurations: the table's choices per GPU class, and the tuner
that may replace them on a GPU (``PAGED_TRITON_AUTOTUNE=1``). Whether the
table's choices compile without spills is test_compile_matrix.py's job."""

from __future__ import annotations

import pytest
import torch

from paged_triton.tile_config import (
    PREFILL_TILES,
    TileConfig,
    autotune_enabled,
    candidates,
    gpu_class,
    smem_limit,
    tile_config,
    tuned,
)


def test_gemma_head_dim_fits_the_small_shared_memory_gpus():
    """head_dim 256 prefill: 8 warps where shared memory is large, a smaller
    4-warp tile on sm_86/sm_89 (99 KB), and unknown GPUs are treated as small."""
    assert tile_config("prefill", 256, torch.bfloat16, 90).num_warps == 8
    assert tile_config("prefill", 256, torch.bfloat16, 80).num_warps == 8
    small = tile_config("prefill", 256, torch.bfloat16, 89)
    assert small == tile_config("prefill", 256, torch.bfloat16, 120)
    assert (small.block_m, small.num_warps) == (32, 4)
    assert smem_limit(89) < smem_limit(80) < smem_limit(90)


def test_prefill_tiles_per_gpu_class():
    """sm_90 is Hopper, the other large-shared-memory GPUs Ampere-like, the
    99 KB ones (and unknown GPUs) Ada-like; head_dim 64 and 128 get 128
    query rows on A100/H100 and 64 keys or more on H100; every tile stays
    within 32-128 rows, 16-128 keys and 4-8 warps."""
    assert [gpu_class(a) for a in (80, 87, 86, 89, 120, 90, None)] == [
        "ampere", "ampere", "ada", "ada", "ada", "hopper", None
    ]
    for arch in (80, 90):
        for head_dim in (64, 128):
            tile = tile_config("prefill", head_dim, torch.float16, arch)
            assert tile.block_m == 128 and (arch == 80 or tile.block_n >= 64)
            assert tile == PREFILL_TILES[gpu_class(arch)][2 * head_dim]
    for tiles in PREFILL_TILES.values():
        for t in tiles.values():
            assert 32 <= t.block_m <= 128 and 16 <= t.block_n <= 128 and t.num_warps in (4, 8)


def test_k_v_tiles_shrink_with_row_size():
    """A float32 row is as wide as a bf16 row of twice the head_dim."""
    decode = [tile_config("decode", d, torch.bfloat16, 90).block_n for d in (64, 128, 256)]
    assert decode == [64, 64, 32]
    assert tile_config("decode", 128, torch.float32, 90) == tile_config(
        "decode", 256, torch.bfloat16, 90
    )
    with pytest.raises(ValueError, match="no tile configuration"):
        tile_config("merge", 128, torch.bfloat16, 90)


def test_candidates_start_with_the_table_choice():
    for kernel in ("decode", "prefill"):
        options = candidates(kernel, 128, torch.bfloat16, 90)
        assert options[0] == tile_config(kernel, 128, torch.bfloat16, 90)
        assert len(set(options)) == len(options) > 1


def test_tuner_keeps_the_fastest_skips_failures_and_measures_once():
    a, b, c = TileConfig(64, 64, 4, 5), TileConfig(64, 32, 8, 5), TileConfig(32, 32, 4, 5)
    calls = []

    def time_ms(tile: TileConfig) -> float:
        calls.append(tile)
        if tile == c:
            raise RuntimeError("out of shared memory")
        return {a: 2.0, b: 1.0}[tile]

    assert tuned(("test", 1), [a, b, c], time_ms) == b
    assert tuned(("test", 1), [a, b, c], time_ms) == b
    assert calls == [a, b, c]  # the second call reused the measurement

    def always_fails(tile: TileConfig) -> float:
        raise RuntimeError("no GPU")

    assert tuned(("test", 2), [c, a], always_fails) == c  # the table's choice stays


def test_autotuning_is_off_unless_asked_and_never_on_cpu(monkeypatch):
    monkeypatch.delenv("PAGED_TRITON_AUTOTUNE", raising=False)
    assert not autotune_enabled(torch.device("cuda", 0))
    monkeypatch.setenv("PAGED_TRITON_AUTOTUNE", "1")
    assert autotune_enabled(torch.device("cuda", 0))
    assert not autotune_enabled(torch.device("cpu"))
